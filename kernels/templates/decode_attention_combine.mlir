{# The splits of decode_attention.mlir combined: a workgroup per row, for each query head
       M = max_s m_s,  w_s = exp(m_s - M) (0 for a split with no key),
       out = sum_s w_s O_s / sum_s w_s z_s  (zeros for a row with no key at all, not 0/0),
   the splits taken in order. Parameters as decode_attention.mlir's
   (fma: the CPU's multiply-add). #}
!part_memref = memref<{{ splits }}x{{ batch }}x{{ q_heads }}x{{ head_dim }}xf32>
!stat_memref = memref<{{ splits }}x{{ batch }}x{{ q_heads }}xf32>
!q_memref = memref<{{ batch }}x{{ q_heads }}x1x{{ head_dim }}x{{ q_type }}>
!q_vec = vector<{{ lanes }}x{{ q_type }}>
!vf = vector<{{ lanes }}xf32>
stream.executable private @{{ name }}_combine_exe {
  stream.executable.export public @{{ name }}_combine workgroups() -> (index, index, index) {
    %n = arith.constant {{ batch }} : index
    %one = arith.constant 1 : index
    stream.return %n, %one, %one : index, index, index
  }
  builtin.module {
    func.func @{{ name }}_combine(%pb: !stream.binding, %mb: !stream.binding, %zb: !stream.binding, %ob: !stream.binding) {
      %c0 = arith.constant 0 : index
      %c1 = arith.constant 1 : index
      %part = stream.binding.subspan %pb[%c0] : !stream.binding -> !part_memref
      %ms = stream.binding.subspan %mb[%c0] : !stream.binding -> !stat_memref
      %zs = stream.binding.subspan %zb[%c0] : !stream.binding -> !stat_memref
      %o = stream.binding.subspan %ob[%c0] : !stream.binding -> !q_memref
      %b = stream.dispatch.workgroup.id[0] : index
      %nq = arith.constant {{ q_heads }} : index
      %nsplit = arith.constant {{ splits }} : index
      %f0 = arith.constant 0.0 : f32
      %f1 = arith.constant 1.0 : f32
      %ninf = arith.constant 0xFF800000 : f32
      %zf = arith.constant dense<0.0> : !vf
{% for c in range(chunks) %}
      %d{{ c }} = arith.constant {{ c * lanes }} : index
{% endfor %}
      scf.for %h = %c0 to %nq step %c1 {
        %m_all = scf.for %s = %c0 to %nsplit step %c1 iter_args(%mx = %ninf) -> (f32) {
          %m = memref.load %ms[%s, %b, %h] : !stat_memref
          %mx2 = arith.maximumf %mx, %m : f32
          scf.yield %mx2 : f32
        }
        %sums:{{ chunks + 1 }} = scf.for %s = %c0 to %nsplit step %c1 iter_args(%za = %f0{% for c in range(chunks) %}, %oa{{ c }} = %zf{% endfor %}) -> (f32{% for c in range(chunks) %}, !vf{% endfor %}) {
          %m = memref.load %ms[%s, %b, %h] : !stat_memref
          %z = memref.load %zs[%s, %b, %h] : !stat_memref
          %dm = arith.subf %m, %m_all : f32
          %e = math.exp %dm : f32
          %some = arith.cmpf ogt, %z, %f0 : f32
          %w = arith.select %some, %e, %f0 : f32
          %wz = arith.mulf %w, %z : f32
          %za2 = arith.addf %za, %wz : f32
          %wv = vector.broadcast %w : f32 to !vf
{% for c in range(chunks) %}
          %p{{ c }} = vector.load %part[%s, %b, %h, %d{{ c }}] : !part_memref, !vf
{% with out = "%oa" ~ c ~ "_2", a = "%wv", b = "%p" ~ c, acc = "%oa" ~ c, type = "!vf", zero = "%zf", pad = "          " %}
{% include "multiply_add.mlir" %}
{% endwith %}
{% endfor %}
          scf.yield %za2{% for c in range(chunks) %}, %oa{{ c }}_2{% endfor %} : f32{% for c in range(chunks) %}, !vf{% endfor +%}
        }
        %pos_z = arith.cmpf ogt, %sums#0, %f0 : f32
        %inv0 = arith.divf %f1, %sums#0 : f32
        %inv = arith.select %pos_z, %inv0, %f0 : f32
        %invb = vector.broadcast %inv : f32 to !vf
{% for c in range(chunks) %}
        %r{{ c }} = arith.mulf %sums#{{ c + 1 }}, %invb : !vf
{% if q_type == "f32" %}
        vector.store %r{{ c }}, %o[%b, %h, %c0, %d{{ c }}] : !q_memref, !q_vec
{% else %}
        %rn{{ c }} = arith.truncf %r{{ c }} : !vf to !q_vec
        vector.store %rn{{ c }}, %o[%b, %h, %c0, %d{{ c }}] : !q_memref, !q_vec
{% endif %}
{% endfor %}
      }
      return
    }
  }
}
