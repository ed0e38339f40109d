{# Decode attention: a workgroup per (row, query head) reads its key/value head's slots [lo, hi) in
   three passes (kernels/attention.py has the arithmetic): scores into the scratch rows with one
   dot product per key, the max and the exponentials 16 keys at a time, then the values weighted.
   Parameters: name, the shape's fields (batch, q_heads, kv_heads, head_dim, slots, length, window,
   kv_mapping, cache_type, q_type), rep (q_heads / kv_heads), scale_bits (the f32 scale's hex bits),
   lanes (features per vector), chunks (head_dim / lanes), fma and f16 (the CPU's float operations). #}
!q_memref = memref<{{ batch }}x{{ q_heads }}x1x{{ head_dim }}x{{ q_type }}>
!kv_memref = memref<{{ batch }}x{{ kv_heads }}x{{ slots }}x{{ head_dim }}x{{ cache_type }}>
!pos_memref = memref<{{ batch }}xi64>
!scratch_memref = memref<{{ batch * q_heads }}x{{ length }}xf32>
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
{% set last = chunks - 1 %}
stream.executable private @{{ name }}_exe {
  stream.executable.export public @{{ name }} workgroups() -> (index, index, index) {
    %n = arith.constant {{ batch * q_heads }} : index
    %one = arith.constant 1 : index
    stream.return %n, %one, %one : index, index, index
  }
  builtin.module {
    func.func @{{ name }}(%qb: !stream.binding, %kb: !stream.binding, %vb: !stream.binding, %pb: !stream.binding, %ob: !stream.binding, %sb: !stream.binding) {
      %c0 = arith.constant 0 : index
      %c1 = arith.constant 1 : index
      %q = stream.binding.subspan %qb[%c0] : !stream.binding -> !q_memref
      %k = stream.binding.subspan %kb[%c0] : !stream.binding -> !kv_memref
      %v = stream.binding.subspan %vb[%c0] : !stream.binding -> !kv_memref
      %sp = stream.binding.subspan %pb[%c0] : !stream.binding -> !pos_memref
      %o = stream.binding.subspan %ob[%c0] : !stream.binding -> !q_memref
      %scr = stream.binding.subspan %sb[%c0] : !stream.binding -> !scratch_memref
      %wg = stream.dispatch.workgroup.id[0] : index
      %nq = arith.constant {{ q_heads }} : index
      %nkv = arith.constant {{ kv_heads }} : index
      %rep = arith.constant {{ rep }} : index
      %b = arith.divui %wg, %nq : index
      %h = arith.remui %wg, %nq : index
{% if kv_mapping == "blocked" %}
      %kvh = arith.divui %h, %rep : index
{% else %}
      %kvh = arith.remui %h, %nkv : index
{% endif %}
      %p64 = memref.load %sp[%b] : !pos_memref
      %p = arith.index_cast %p64 : i64 to index
      %p1 = arith.addi %p, %c1 : index
      %len = arith.constant {{ length }} : index
      %hi = arith.minsi %p1, %len : index
{% if window %}
      %win = arith.constant {{ window }} : index
      %lo0 = arith.subi %p1, %win : index
      %lo = arith.maxsi %lo0, %c0 : index
{% else %}
      %lo = arith.constant 0 : index
{% endif %}
      %scale = arith.constant 0x{{ scale_bits }} : f32
      %f0 = arith.constant 0.0 : f32
      %f1 = arith.constant 1.0 : f32
      %zf = arith.constant dense<0.0> : !vf
{% for c in range(chunks) %}
      %d{{ c }} = arith.constant {{ c * lanes }} : index
{% endfor %}
{% for c in range(chunks) %}
      %qs{{ c }} = vector.load %q[%b, %h, %c0, %d{{ c }}] : !q_memref, !q_vec
{{ widen(q_type, "%qs" ~ c, "%q" ~ c, "      ") }}
{%- endfor %}
      scf.for %l = %lo to %hi step %c1 {
{% for c in range(chunks) %}
        %kh{{ c }} = vector.load %k[%b, %kvh, %l, %d{{ c }}] : !kv_memref, !kv_vec
{{ widen(cache_type, "%kh" ~ c, "%kf" ~ c, "        ") }}
{%- endfor %}
{# two accumulator chains over the features, added at the end #}
{% for c in range(chunks) %}
{{ multiply_add("%a" ~ c, "%q" ~ c, "%kf" ~ c, "%zf" if c < 2 else "%a" ~ (c - 2), "        ") }}
{%- endfor %}
        %dot = arith.addf %a{{ last - last % 2 }}, {{ "%a" ~ (last - 1 + last % 2) if last else "%zf" }} : !vf
        %sum = vector.reduction <add>, %dot : !vf into f32
        %sc = arith.mulf %sum, %scale : f32
        memref.store %sc, %scr[%wg, %l] : !scratch_memref
      }
{# the max and the exponentials 16 keys at a time; lanes past hi are masked off #}
      %c{{ lanes }} = arith.constant {{ lanes }} : index
      %ninfv = arith.constant dense<0xFF800000> : !vf
      %mv = scf.for %l = %lo to %hi step %c{{ lanes }} iter_args(%mx = %ninfv) -> (!vf) {
        %rem = arith.subi %hi, %l : index
        %mask = vector.create_mask %rem : !mask
        %sv = vector.maskedload %scr[%wg, %l], %mask, %ninfv : !scratch_memref, !mask, !vf into !vf
        %mx2 = arith.maximumf %mx, %sv : !vf
        scf.yield %mx2 : !vf
      }
      %m = vector.reduction <maximumf>, %mv : !vf into f32
      %mb = vector.broadcast %m : f32 to !vf
      %zv = scf.for %l = %lo to %hi step %c{{ lanes }} iter_args(%zacc = %zf) -> (!vf) {
        %rem = arith.subi %hi, %l : index
        %mask = vector.create_mask %rem : !mask
        %sv = vector.maskedload %scr[%wg, %l], %mask, %mb : !scratch_memref, !mask, !vf into !vf
        %sm = arith.subf %sv, %mb : !vf
        %e0 = math.exp %sm : !vf
        %e = arith.select %mask, %e0, %zf : !mask, !vf
        vector.maskedstore %scr[%wg, %l], %mask, %e : !scratch_memref, !mask, !vf
        %zacc2 = arith.addf %zacc, %e : !vf
        scf.yield %zacc2 : !vf
      }
      %z = vector.reduction <add>, %zv : !vf into f32
      %acc:{{ chunks }} = scf.for %l = %lo to %hi step %c1 iter_args({% for c in range(chunks) %}%o{{ c }} = %zf{{ ", " if not loop.last }}{% endfor %}) -> ({% for c in range(chunks) %}!vf{{ ", " if not loop.last }}{% endfor %}) {
        %pr = memref.load %scr[%wg, %l] : !scratch_memref
        %pbv = vector.broadcast %pr : f32 to !vf
{% for c in range(chunks) %}
        %vh{{ c }} = vector.load %v[%b, %kvh, %l, %d{{ c }}] : !kv_memref, !kv_vec
{{ widen(cache_type, "%vh" ~ c, "%vf" ~ c, "        ") -}}
{{ multiply_add("%n" ~ c, "%pbv", "%vf" ~ c, "%o" ~ c, "        ") }}
{%- endfor %}
        scf.yield {% for c in range(chunks) %}%n{{ c }}{{ ", " if not loop.last }}{% endfor %} : {% for c in range(chunks) %}!vf{{ ", " if not loop.last }}{% endfor +%}
      }
{# no key (a row whose position is outside the cache) gives zeros, not 0/0 #}
      %pos_z = arith.cmpf ogt, %z, %f0 : f32
      %inv0 = arith.divf %f1, %z : f32
      %inv = arith.select %pos_z, %inv0, %f0 : f32
      %invb = vector.broadcast %inv : f32 to !vf
{% for c in range(chunks) %}
      %r{{ c }} = arith.mulf %acc#{{ c }}, %invb : !vf
{% if q_type == "f32" %}
      vector.store %r{{ c }}, %o[%b, %h, %c0, %d{{ c }}] : !q_memref, !q_vec
{% else %}
      %rn{{ c }} = arith.truncf %r{{ c }} : !vf to !q_vec
      vector.store %rn{{ c }}, %o[%b, %h, %c0, %d{{ c }}] : !q_memref, !q_vec
{% endif %}
{% endfor %}
      return
    }
  }
}
