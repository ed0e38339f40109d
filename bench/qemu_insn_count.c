/*
 * A qemu-user TCG plugin that counts the guest instructions a program executes,
 * and reads the count at marks the program sets (bench/arm_instructions.py).
 *
 * A mark is a write(2) to the file descriptor MARK_FD: the syscall fails with
 * EBADF in the guest, and the plugin appends "<length> <instructions so far>"
 * to the file named by its `out=PATH` argument, the length naming the mark.
 * At exit it appends "exit <instructions>". With the argument `pages=on`, each
 * mark also appends "page <mark> <address> <instructions>" for every 4 KiB
 * page of guest code executed so far: where the instructions went, which the
 * caller maps to libraries through the guest's /proc/self/maps.
 *
 * Every translated block adds its instruction count when it starts, with an
 * atomic add, so the threads of a multi-threaded guest are all counted.
 *
 * The declarations below are the part of QEMU's plugin API (version 1, QEMU 7.2
 * as Debian 12 ships it) this plugin uses; later QEMU versions keep them.
 */
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define QEMU_PLUGIN_EXPORT __attribute__((visibility("default")))
#define MARK_FD 987654
#define AARCH64_SYS_WRITE 64

typedef uint64_t qemu_plugin_id_t;
struct qemu_info_t;
struct qemu_plugin_tb;
enum qemu_plugin_cb_flags { QEMU_PLUGIN_CB_NO_REGS, QEMU_PLUGIN_CB_R_REGS, QEMU_PLUGIN_CB_RW_REGS };

typedef void (*qemu_plugin_vcpu_udata_cb_t)(unsigned int vcpu_index, void *userdata);
typedef void (*qemu_plugin_vcpu_tb_trans_cb_t)(qemu_plugin_id_t id, struct qemu_plugin_tb *tb);
typedef void (*qemu_plugin_vcpu_syscall_cb_t)(qemu_plugin_id_t id, unsigned int vcpu_index, int64_t num,
                                              uint64_t a1, uint64_t a2, uint64_t a3, uint64_t a4,
                                              uint64_t a5, uint64_t a6, uint64_t a7, uint64_t a8);
typedef void (*qemu_plugin_udata_cb_t)(qemu_plugin_id_t id, void *userdata);

void qemu_plugin_register_vcpu_tb_trans_cb(qemu_plugin_id_t id, qemu_plugin_vcpu_tb_trans_cb_t cb);
void qemu_plugin_register_vcpu_tb_exec_cb(struct qemu_plugin_tb *tb, qemu_plugin_vcpu_udata_cb_t cb,
                                          enum qemu_plugin_cb_flags flags, void *userdata);
size_t qemu_plugin_tb_n_insns(const struct qemu_plugin_tb *tb);
uint64_t qemu_plugin_tb_vaddr(const struct qemu_plugin_tb *tb);
void qemu_plugin_register_vcpu_syscall_cb(qemu_plugin_id_t id, qemu_plugin_vcpu_syscall_cb_t cb);
void qemu_plugin_register_atexit_cb(qemu_plugin_id_t id, qemu_plugin_udata_cb_t cb, void *userdata);

QEMU_PLUGIN_EXPORT int qemu_plugin_version = 1;

static uint64_t executed;
static FILE *out;

/* With pages=on: every translated block, with the instructions it has executed. */
struct block {
    uint64_t vaddr;
    uint64_t n_insns;
    uint64_t executed;
};
static int by_page;
static struct block **blocks;
static size_t n_blocks, blocks_capacity;
static pthread_mutex_t blocks_lock = PTHREAD_MUTEX_INITIALIZER;

static void block_executed(unsigned int vcpu_index, void *n_insns)
{
    (void)vcpu_index;
    __atomic_fetch_add(&executed, (uint64_t)(uintptr_t)n_insns, __ATOMIC_RELAXED);
}

static void tracked_block_executed(unsigned int vcpu_index, void *userdata)
{
    (void)vcpu_index;
    struct block *b = userdata;
    __atomic_fetch_add(&executed, b->n_insns, __ATOMIC_RELAXED);
    __atomic_fetch_add(&b->executed, b->n_insns, __ATOMIC_RELAXED);
}

static void block_translated(qemu_plugin_id_t id, struct qemu_plugin_tb *tb)
{
    (void)id;
    size_t n = qemu_plugin_tb_n_insns(tb);
    if (!by_page) {
        qemu_plugin_register_vcpu_tb_exec_cb(tb, block_executed, QEMU_PLUGIN_CB_NO_REGS, (void *)(uintptr_t)n);
        return;
    }
    struct block *b = calloc(1, sizeof *b);
    b->vaddr = qemu_plugin_tb_vaddr(tb);
    b->n_insns = n;
    pthread_mutex_lock(&blocks_lock);
    if (n_blocks == blocks_capacity) {
        blocks_capacity = blocks_capacity ? 2 * blocks_capacity : 65536;
        blocks = realloc(blocks, blocks_capacity * sizeof *blocks);
    }
    blocks[n_blocks++] = b;
    pthread_mutex_unlock(&blocks_lock);
    qemu_plugin_register_vcpu_tb_exec_cb(tb, tracked_block_executed, QEMU_PLUGIN_CB_NO_REGS, b);
}

static int by_address(const void *a, const void *b)
{
    uint64_t x = (*(struct block *const *)a)->vaddr, y = (*(struct block *const *)b)->vaddr;
    return x < y ? -1 : x > y;
}

/* "page <mark> <page address> <instructions>" for every page executed so far, summed over its blocks. */
static void write_pages(uint64_t mark)
{
    pthread_mutex_lock(&blocks_lock);
    qsort(blocks, n_blocks, sizeof *blocks, by_address);
    uint64_t page = 0, total = 0;
    for (size_t i = 0; i < n_blocks; i++) {
        uint64_t p = blocks[i]->vaddr & ~(uint64_t)4095;
        if (p != page && total) {
            fprintf(out, "page %llu %llu %llu\n", (unsigned long long)mark, (unsigned long long)page,
                    (unsigned long long)total);
            total = 0;
        }
        page = p;
        total += __atomic_load_n(&blocks[i]->executed, __ATOMIC_RELAXED);
    }
    if (total) {
        fprintf(out, "page %llu %llu %llu\n", (unsigned long long)mark, (unsigned long long)page,
                (unsigned long long)total);
    }
    pthread_mutex_unlock(&blocks_lock);
}

static void syscall_entered(qemu_plugin_id_t id, unsigned int vcpu_index, int64_t num, uint64_t a1,
                            uint64_t a2, uint64_t a3, uint64_t a4, uint64_t a5, uint64_t a6, uint64_t a7,
                            uint64_t a8)
{
    (void)id; (void)vcpu_index; (void)a2; (void)a4; (void)a5; (void)a6; (void)a7; (void)a8;
    if (num == AARCH64_SYS_WRITE && a1 == MARK_FD) {
        fprintf(out, "%llu %llu\n", (unsigned long long)a3,
                (unsigned long long)__atomic_load_n(&executed, __ATOMIC_RELAXED));
        if (by_page) {
            write_pages(a3);
        }
        fflush(out);
    }
}

static void exited(qemu_plugin_id_t id, void *userdata)
{
    (void)id; (void)userdata;
    fprintf(out, "exit %llu\n", (unsigned long long)__atomic_load_n(&executed, __ATOMIC_RELAXED));
    fclose(out);
}

QEMU_PLUGIN_EXPORT int qemu_plugin_install(qemu_plugin_id_t id, const struct qemu_info_t *info, int argc,
                                           char **argv)
{
    (void)info;
    const char *path = NULL;
    for (int i = 0; i < argc; i++) {
        if (strncmp(argv[i], "out=", 4) == 0) {
            path = argv[i] + 4;
        } else if (strcmp(argv[i], "pages=on") == 0) {
            by_page = 1;
        }
    }
    if (path == NULL || (out = fopen(path, "w")) == NULL) {
        fprintf(stderr, "qemu_insn_count: needs out=PATH, a file it can write\n");
        return -1;
    }
    qemu_plugin_register_vcpu_tb_trans_cb(id, block_translated);
    qemu_plugin_register_vcpu_syscall_cb(id, syscall_entered);
    qemu_plugin_register_atexit_cb(id, exited, NULL);
    return 0;
}
