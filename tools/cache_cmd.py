"""foldline cache ls|clear: the compile cache under $FOLDLINE_CACHE/compiled."""

from __future__ import annotations

import time


def add_parser(sub) -> None:
    p = sub.add_parser("cache", help="list or clear the compile cache ($FOLDLINE_CACHE/compiled)")
    p.add_argument("action", choices=["ls", "clear"], help="ls: the cached bundles; clear: remove them all")
    p.set_defaults(func=run)


def run(args) -> int:
    from ..backends.compile_cache import CompileCache

    cache = CompileCache()
    if args.action == "clear":
        freed = cache.clear()
        print(f"removed {freed / 1e6:.1f} MB from {cache.root}")
        return 0
    entries = cache.entries()
    total = sum(e.size for e in entries)
    print(f"{cache.root}: {len(entries)} bundle(s), {total / 1e6:.1f} MB of {cache.max_bytes / (1 << 30):.1f} GiB "
          "(FOLDLINE_CACHE_MAX_GB)")
    for e in entries:
        used = time.strftime("%Y-%m-%d %H:%M", time.localtime(e.last_used))
        targets = ", ".join(e.info.get("targets", []))
        print(f"  {e.key[:16]}  {e.size / 1e6:8.1f} MB  used {used}  {e.info.get('name', '?')} [{targets}]")
    return 0
