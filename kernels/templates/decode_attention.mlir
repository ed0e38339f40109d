{# Decode attention, split over the keys: a workgroup per (row, key/value head, split) reads its
   share of that head's slots once for all `rep` query heads that share it, in three passes
   (kernels/attention.py has the arithmetic): scores into the scratch rows with one dot product per
   key and query head, the max and the exponentials 16 keys at a time per query head, then the
   values weighted, a block of features at a time. It leaves each query head's unnormalized sum
   of values, its max and its sum of exponentials per split; decode_attention_combine.mlir
   combines the splits.
   Parameters: name, the shape's fields (batch, q_heads, kv_heads, head_dim, slots, length, window,
   kv_mapping, cache_type, q_type), rep (q_heads / kv_heads), scale_bits (the f32 scale's hex bits),
   splits (workgroups per row and key/value head), lanes (features per vector), chunks
   (head_dim / lanes), blocks (first chunk, end chunk, the (query head, chunk) accumulators and the
   cache lines of each block of features the value pass takes together), line_offsets (the cache
   lines of a row), prefetch_keys (how far ahead a pass asks for slots), fma and f16 (the CPU's
   float operations), write (the step's own keys and values, of new_type, come in as two more bindings
   after the caches, and each row's valid count after pos; for a row with a valid token, the
   workgroup whose share holds slot pos % slots converts them to cache_type (a narrowing where
   `narrows`) and stores them there before it reads: the caches are read-write, and the call ties
   them to its results). #}
!q_memref = memref<{{ batch }}x{{ q_heads }}x1x{{ head_dim }}x{{ q_type }}>
!kv_memref = memref<{{ batch }}x{{ kv_heads }}x{{ slots }}x{{ head_dim }}x{{ cache_type }}>
!pos_memref = memref<{{ batch }}xi64>
!new_memref = memref<{{ batch }}x{{ kv_heads }}x1x{{ head_dim }}x{{ new_type }}>
!new_vec = vector<{{ lanes }}x{{ new_type }}>
!scratch_memref = memref<{{ batch * q_heads }}x{{ length }}xf32>
!part_memref = memref<{{ splits }}x{{ batch }}x{{ q_heads }}x{{ head_dim }}xf32>
!stat_memref = memref<{{ splits }}x{{ batch }}x{{ q_heads }}xf32>
!q_vec = vector<{{ lanes }}x{{ q_type }}>
!kv_vec = vector<{{ lanes }}x{{ cache_type }}>
!vf = vector<{{ lanes }}xf32>
!mask = vector<{{ lanes }}xi1>
{# `dst` = the vector `src` of `elem` as f32; an f32 vector is added to zero, which folds away and keeps one name #}
{% macro widen(elem, src, dst, pad) %}
{% if elem == "f32" %}
{{ pad }}{{ dst }} = arith.addf {{ src }}, %zf : !vf
{% elif elem == "f16" %}
{% with f16_type = "vector<" ~ lanes ~ "xf16>" %}
{% include "widen_f16.mlir" %}
{% endwith %}
{% else %}
{{ pad }}{{ dst }} = arith.extf {{ src }} : vector<{{ lanes }}x{{ elem }}> to !vf
{% endif %}
{% endmacro %}
{% macro multiply_add(out, a, b, acc, pad) %}
{% with type = "!vf", zero = "%zf" %}
{% include "multiply_add.mlir" %}
{% endwith %}
{% endmacro %}
{# prefetch the cache lines `lines` (offsets into a row) of `mem`'s slot `ahead` keys past %l, at most the last slot #}
{% macro prefetch(mem, lines, tag) %}
        %ahead_l{{ tag }} = arith.addi %l, %ahead : index
        %ahead_s{{ tag }} = arith.minsi %ahead_l{{ tag }}, %last_slot : index
{% for e in lines %}
        memref.prefetch {{ mem }}[%b, %kvh, %ahead_s{{ tag }}, %line{{ e }}], read, locality<3>, data : !kv_memref
{% endfor %}
{% endmacro %}
{% set last = chunks - 1 %}
{% set heads = range(rep) %}
stream.executable private @{{ name }}_exe {
  stream.executable.export public @{{ name }} workgroups() -> (index, index, index) {
    %n = arith.constant {{ batch * kv_heads * splits }} : index
    %one = arith.constant 1 : index
    stream.return %n, %one, %one : index, index, index
  }
  builtin.module {
    func.func @{{ name }}(%qb: !stream.binding, %kb: !stream.binding, %vb: !stream.binding, {% if write %}%knb: !stream.binding, %vnb: !stream.binding, {% endif %}%pb: !stream.binding, {% if write %}%nvb: !stream.binding, {% endif %}%ob: !stream.binding, %mb: !stream.binding, %zb: !stream.binding, %sb: !stream.binding) {
      %c0 = arith.constant 0 : index
      %c1 = arith.constant 1 : index
      %q = stream.binding.subspan %qb[%c0] : !stream.binding -> !q_memref
      %k = stream.binding.subspan %kb[%c0] : !stream.binding -> !kv_memref
      %v = stream.binding.subspan %vb[%c0] : !stream.binding -> !kv_memref
{% if write %}
      %kn = stream.binding.subspan %knb[%c0] : !stream.binding -> !new_memref
      %vn = stream.binding.subspan %vnb[%c0] : !stream.binding -> !new_memref
{% endif %}
      %sp = stream.binding.subspan %pb[%c0] : !stream.binding -> !pos_memref
{% if write %}
      %nv = stream.binding.subspan %nvb[%c0] : !stream.binding -> !pos_memref
{% endif %}
      %o = stream.binding.subspan %ob[%c0] : !stream.binding -> !part_memref
      %mo = stream.binding.subspan %mb[%c0] : !stream.binding -> !stat_memref
      %zo = stream.binding.subspan %zb[%c0] : !stream.binding -> !stat_memref
      %scr = stream.binding.subspan %sb[%c0] : !stream.binding -> !scratch_memref
      %wg = stream.dispatch.workgroup.id[0] : index
      %nq = arith.constant {{ q_heads }} : index
      %nkv = arith.constant {{ kv_heads }} : index
      %nsplit = arith.constant {{ splits }} : index
      %nsplit_less = arith.constant {{ splits - 1 }} : index
      %split = arith.remui %wg, %nsplit : index
      %bkv = arith.divui %wg, %nsplit : index
      %b = arith.divui %bkv, %nkv : index
      %kvh = arith.remui %bkv, %nkv : index
      %row_base = arith.muli %b, %nq : index
{% if kv_mapping == "blocked" %}
      %rep = arith.constant {{ rep }} : index
      %kvh_rep = arith.muli %kvh, %rep : index
{% endif %}
{# the query heads reading this key/value head, and their scratch rows #}
{% for j in heads %}
      %j{{ j }} = arith.constant {{ j }} : index
{% if kv_mapping == "blocked" %}
      %h{{ j }} = arith.addi %kvh_rep, %j{{ j }} : index
{% else %}
      %hb{{ j }} = arith.muli %j{{ j }}, %nkv : index
      %h{{ j }} = arith.addi %hb{{ j }}, %kvh : index
{% endif %}
      %row{{ j }} = arith.addi %row_base, %h{{ j }} : index
{% endfor %}
      %p64 = memref.load %sp[%b] : !pos_memref
      %p = arith.index_cast %p64 : i64 to index
      %p1 = arith.addi %p, %c1 : index
      %len = arith.constant {{ length }} : index
      %hi = arith.minsi %p1, %len : index
{% if window %}
      %win = arith.constant {{ window }} : index
      %first0 = arith.subi %p1, %win : index
      %first = arith.maxsi %first0, %c0 : index
{% else %}
      %first = arith.constant 0 : index
{% endif %}
{# this workgroup's share of the keys [first, hi): split s takes [lo, hi) of ceil(n / splits) keys each #}
      %keys = arith.subi %hi, %first : index
      %keys_up = arith.addi %keys, %nsplit_less : index
      %share = arith.divsi %keys_up, %nsplit : index
      %skip = arith.muli %split, %share : index
      %lo_all = arith.addi %first, %skip : index
      %lo = arith.minsi %lo_all, %hi : index
      %end_all = arith.addi %lo, %share : index
      %hi_s = arith.minsi %end_all, %hi : index
      %scale = arith.constant 0x{{ scale_bits }} : f32
      %zf = arith.constant dense<0.0> : !vf
{% for c in range(chunks) %}
      %d{{ c }} = arith.constant {{ c * lanes }} : index
{% endfor %}
{% for e in line_offsets %}
      %line{{ e }} = arith.constant {{ e }} : index
{% endfor %}
{% if write %}
{# a row's valid token into slot pos % slots by the one workgroup of its key/value head whose share
   holds that slot (every slot of [first, hi) is in one share, and the slot written is in it), before
   any read: no other workgroup reads that slot of that head; a row with none keeps its caches #}
      %nslots = arith.constant {{ slots }} : index
      %slot = arith.remui %p, %nslots : index
      %from_lo = arith.cmpi sge, %slot, %lo : index
      %below_hi = arith.cmpi slt, %slot, %hi_s : index
      %in_share = arith.andi %from_lo, %below_hi : i1
      %valid64 = memref.load %nv[%b] : !pos_memref
      %zero64 = arith.constant 0 : i64
      %valid = arith.cmpi sgt, %valid64, %zero64 : i64
      %writes = arith.andi %in_share, %valid : i1
      scf.if %writes {
{% for c in range(chunks) %}
{% for x in ("k", "v") %}
        %w{{ x }}n{{ c }} = vector.load %{{ x }}n[%b, %kvh, %c0, %d{{ c }}] : !new_memref, !new_vec
{% if new_type == cache_type %}
        vector.store %w{{ x }}n{{ c }}, %{{ x }}[%b, %kvh, %slot, %d{{ c }}] : !kv_memref, !kv_vec
{% else %}
        %w{{ x }}{{ c }} = arith.{{ "truncf" if narrows else "extf" }} %w{{ x }}n{{ c }} : !new_vec to !kv_vec
        vector.store %w{{ x }}{{ c }}, %{{ x }}[%b, %kvh, %slot, %d{{ c }}] : !kv_memref, !kv_vec
{% endif %}
{% endfor %}
{% endfor %}
      }
{% endif %}
      %ahead = arith.constant {{ prefetch_keys }} : index
      %last_slot = arith.constant {{ slots - 1 }} : index
{% for j in heads %}
{% for c in range(chunks) %}
      %qs{{ j }}_{{ c }} = vector.load %q[%b, %h{{ j }}, %c0, %d{{ c }}] : !q_memref, !q_vec
{{ widen(q_type, "%qs" ~ j ~ "_" ~ c, "%q" ~ j ~ "_" ~ c, "      ") }}
{%- endfor %}
{% endfor %}
      scf.for %l = %lo to %hi_s step %c1 {
{{ prefetch("%k", line_offsets, "k") -}}
{% for c in range(chunks) %}
        %kh{{ c }} = vector.load %k[%b, %kvh, %l, %d{{ c }}] : !kv_memref, !kv_vec
{{ widen(cache_type, "%kh" ~ c, "%kf" ~ c, "        ") }}
{%- endfor %}
{# per query head, two accumulator chains over the features, added at the end #}
{% for j in heads %}
{% for c in range(chunks) %}
{{ multiply_add("%a" ~ j ~ "_" ~ c, "%q" ~ j ~ "_" ~ c, "%kf" ~ c, "%zf" if c < 2 else "%a" ~ j ~ "_" ~ (c - 2), "        ") }}
{%- endfor %}
        %dot{{ j }} = arith.addf %a{{ j }}_{{ last - last % 2 }}, {{ "%a" ~ j ~ "_" ~ (last - 1 + last % 2) if last else "%zf" }} : !vf
        %sum{{ j }} = vector.reduction <add>, %dot{{ j }} : !vf into f32
        %sc{{ j }} = arith.mulf %sum{{ j }}, %scale : f32
        memref.store %sc{{ j }}, %scr[%row{{ j }}, %l] : !scratch_memref
{% endfor %}
      }
{# per query head, the max and the exponentials 16 keys at a time; lanes past hi are masked off #}
      %c{{ lanes }} = arith.constant {{ lanes }} : index
      %ninfv = arith.constant dense<0xFF800000> : !vf
{% for j in heads %}
      %mv{{ j }} = scf.for %l = %lo to %hi_s step %c{{ lanes }} iter_args(%mx = %ninfv) -> (!vf) {
        %rem = arith.subi %hi_s, %l : index
        %mask = vector.create_mask %rem : !mask
        %sv = vector.maskedload %scr[%row{{ j }}, %l], %mask, %ninfv : !scratch_memref, !mask, !vf into !vf
        %mx2 = arith.maximumf %mx, %sv : !vf
        scf.yield %mx2 : !vf
      }
      %m{{ j }} = vector.reduction <maximumf>, %mv{{ j }} : !vf into f32
      %mb{{ j }} = vector.broadcast %m{{ j }} : f32 to !vf
      %zv{{ j }} = scf.for %l = %lo to %hi_s step %c{{ lanes }} iter_args(%zacc = %zf) -> (!vf) {
        %rem = arith.subi %hi_s, %l : index
        %mask = vector.create_mask %rem : !mask
        %sv = vector.maskedload %scr[%row{{ j }}, %l], %mask, %mb{{ j }} : !scratch_memref, !mask, !vf into !vf
        %sm = arith.subf %sv, %mb{{ j }} : !vf
        %e0 = math.exp %sm : !vf
        %e = arith.select %mask, %e0, %zf : !mask, !vf
        vector.maskedstore %scr[%row{{ j }}, %l], %mask, %e : !scratch_memref, !mask, !vf
        %zacc2 = arith.addf %zacc, %e : !vf
        scf.yield %zacc2 : !vf
      }
      %z{{ j }} = vector.reduction <add>, %zv{{ j }} : !vf into f32
      memref.store %m{{ j }}, %mo[%split, %b, %h{{ j }}] : !stat_memref
      memref.store %z{{ j }}, %zo[%split, %b, %h{{ j }}] : !stat_memref
{% endfor %}
{# the values weighted: every query head's accumulators of one block of feature chunks at a time #}
{% for first, end, accs, lines in blocks %}
      %acc{{ first }}:{{ accs | length }} = scf.for %l = %lo to %hi_s step %c1 iter_args({% for j, c in accs %}%o{{ j }}_{{ c }} = %zf{{ ", " if not loop.last }}{% endfor %}) -> ({% for _ in accs %}!vf{{ ", " if not loop.last }}{% endfor %}) {
{{ prefetch("%v", lines, "v") -}}
{% for c in range(first, end) %}
        %vh{{ c }} = vector.load %v[%b, %kvh, %l, %d{{ c }}] : !kv_memref, !kv_vec
{{ widen(cache_type, "%vh" ~ c, "%vf" ~ c, "        ") -}}
{% endfor %}
{% for j in heads %}
        %pr{{ j }} = memref.load %scr[%row{{ j }}, %l] : !scratch_memref
        %pbv{{ j }} = vector.broadcast %pr{{ j }} : f32 to !vf
{% for c in range(first, end) %}
{{ multiply_add("%n" ~ j ~ "_" ~ c, "%pbv" ~ j, "%vf" ~ c, "%o" ~ j ~ "_" ~ c, "        ") }}
{%- endfor %}
{% endfor %}
        scf.yield {% for j, c in accs %}%n{{ j }}_{{ c }}{{ ", " if not loop.last }}{% endfor %} : {% for _ in accs %}!vf{{ ", " if not loop.last }}{% endfor +%}
      }
{% for j, c in accs %}
      vector.store %acc{{ first }}#{{ loop.index0 }}, %o[%split, %b, %h{{ j }}, %d{{ c }}] : !part_memref, !vf
{% endfor %}
{% endfor %}
      return
    }
  }
}
