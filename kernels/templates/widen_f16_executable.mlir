{# A dispatch converting `count` arrays of `size` f16 bit patterns (i16) to f32, for the half-group
   kernel on a CPU without F16C (kernels/qlinear.py, `_widen_scales_executable`, says why it is
   hand-written): `workgroups` workgroups of size / workgroups values, `lanes` values per vector step,
   each converted in integer code (f16_bits_to_f32.mlir). Bindings: the count sources, then the count
   results. Parameters: name, size, count, lanes, workgroups. #}
!bits_memref = memref<{{ size }}xi16>
!f32_memref = memref<{{ size }}xf32>
!bits_vec = vector<{{ lanes }}xi16>
!vf = vector<{{ lanes }}xf32>
stream.executable private @{{ name }}_exe {
  stream.executable.export public @{{ name }} workgroups() -> (index, index, index) {
    %n = arith.constant {{ workgroups }} : index
    %one = arith.constant 1 : index
    stream.return %n, %one, %one : index, index, index
  }
  builtin.module {
    func.func @{{ name }}({% for i in range(count) %}%sb{{ i }}: !stream.binding, {% endfor %}{% for i in range(count) %}%db{{ i }}: !stream.binding{{ ", " if not loop.last }}{% endfor %}) {
      %c0 = arith.constant 0 : index
      %step = arith.constant {{ lanes }} : index
      %per = arith.constant {{ size // workgroups }} : index
      %wg = stream.dispatch.workgroup.id[0] : index
      %lo = arith.muli %wg, %per : index
      %hi = arith.addi %lo, %per : index
{% for i in range(count) %}
      %src{{ i }} = stream.binding.subspan %sb{{ i }}[%c0] : !stream.binding -> !bits_memref
      %dst{{ i }} = stream.binding.subspan %db{{ i }}[%c0] : !stream.binding -> !f32_memref
{% endfor %}
      scf.for %i = %lo to %hi step %step {
{% for i in range(count) %}
        %h{{ i }} = vector.load %src{{ i }}[%i] : !bits_memref, !bits_vec
{% with src = "%h" ~ i, dst = "%f" ~ i, i16_type = "vector<" ~ lanes ~ "xi16>", pad = "        " %}
{% include "f16_bits_to_f32.mlir" %}
{% endwith %}
        vector.store %f{{ i }}, %dst{{ i }}[%i] : !f32_memref, !vf
{% endfor %}
      }
      return
    }
  }
}
