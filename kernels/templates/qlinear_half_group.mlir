{# Decode of m = 1 to 8 activation rows reading each code once, one lane per half-group pair
   (kernels/qlinear.py, `half_group_mlir`, says why this form): lane l of group g takes codes l and
   l + g/2, which meet x[l] (%xa) and x[l + g/2] (%xb), and keeps a partial sum per output row:

       part[(b,) r, l] += s[r, g] * (xa * lo + xb * hi) (+ min[r, g] * (xa + xb))
       y[(b,) r] = sum_l part[(b,) r, l]

   q4: one byte read (%qb) holds both codes, low nibble and high; q8 (and widened q5): the two
   half-group slices of the codes (%q0, %q1). With several rows (`b`, batched decode) every row
   keeps its own partial sums and the codes are read once for all. widen_scales: the executable
   converting f16 scales (and mins) to f32 before the kernel (widen_f16_executable.mlir), or none.
   Parameters: name, the shape's fields (fmt, group, groups, scale_type, has_min, x_shape, m, n, k,
   stored_codes), lanes (group / 2), distribution, parallel and reduction (the tiles), widen_scales,
   fma and f16 (the CPU's float operations). #}
{% set multi = m > 1 %}
{% set dims = "b, r, l, g" if multi else "r, l, g" %}
{% set batch = "b, " if multi else "" %}
{% set scale_names = ["%scales", "%mins"] if has_min else ["%scales"] %}
{% set read_scale_type = "f32" if widen_scales else scale_type %}
{% set code_map = "affine_map<(" ~ dims ~ ") -> (r, g, l)>" %}
{% set x_map = "affine_map<(" ~ dims ~ ") -> (" ~ batch ~ "g, l)>" %}
!x_tensor = tensor<{{ x_shape | join("x") }}xf32>
!y_tensor = tensor<{{ ((x_shape[:-1] | list) + [n]) | join("x") }}xf32>
!stored_codes = tensor<{{ stored_codes | join("x") }}xi8>
!codes = tensor<{{ n }}x{{ k // 2 if fmt == "q4" else k }}xi8>
!scales = tensor<{{ n }}x{{ groups }}x{{ scale_type }}>
!read_scales = tensor<{{ n }}x{{ groups }}x{{ read_scale_type }}>
!code_half = tensor<{{ n }}x{{ groups }}x{{ lanes }}xi8>
!code_pair = tensor<{{ n }}x{{ groups }}x2x{{ lanes }}xi8>
!x_rows = tensor<{{ m }}x{{ k }}xf32>
!x_row = tensor<{{ k }}xf32>
!x_tile = tensor<{{ m ~ "x" if multi }}{{ groups }}x2x{{ lanes }}xf32>
!x_half = tensor<{{ m ~ "x" if multi }}{{ groups }}x{{ lanes }}xf32>
!part = tensor<{{ m ~ "x" if multi }}{{ n }}x{{ lanes }}xf32>
!acc = tensor<{{ m ~ "x" if multi }}{{ n }}xf32>
!y_rows = tensor<{{ m }}x{{ n }}xf32>
!scale_bits = tensor<{{ n }}x{{ groups }}xi16>
!flat_bits = tensor<{{ n * groups }}xi16>
!flat_f32 = tensor<{{ n * groups }}xf32>
util.func private @{{ name }}(%x: !x_tensor, {{ "%codes_q5" if fmt == "q5" else "%codes" }}: !stored_codes, %scales: !scales{{ ", %mins: !scales" if has_min }}) -> !y_tensor {
{% if fmt == "q5" %}
{% with pad = "  " %}
{% include "qlinear_widen_q5.mlir" %}
{% endwith %}
{% endif %}
{% if fmt == "q4" %}
  %qb = tensor.expand_shape %codes [[0], [1, 2]] output_shape [{{ n }}, {{ groups }}, {{ lanes }}] : !codes into !code_half
{% else %}
  %c4 = tensor.expand_shape %codes [[0], [1, 2, 3]] output_shape [{{ n }}, {{ groups }}, 2, {{ lanes }}] : !codes into !code_pair
{% for h in (0, 1) %}
  %q{{ h }} = tensor.extract_slice %c4[0, 0, {{ h }}, 0] [{{ n }}, {{ groups }}, 1, {{ lanes }}] [1, 1, 1, 1] : !code_pair to !code_half
{% endfor %}
{% endif %}
{% with pad = "  " %}
{% include "qlinear_x_rows.mlir" %}
{% endwith %}
{% if multi %}
  %xv = tensor.expand_shape %x2 [[0], [1, 2, 3]] output_shape [{{ m }}, {{ groups }}, 2, {{ lanes }}] : !x_rows into !x_tile
{% else %}
  %x1 = tensor.collapse_shape %x2 [[0, 1]] : !x_rows into !x_row
  %xv = tensor.expand_shape %x1 [[0, 1, 2]] output_shape [{{ groups }}, 2, {{ lanes }}] : !x_row into !x_tile
{% endif %}
{% for half, h in (("%xa", 0), ("%xb", 1)) %}
  {{ half }} = tensor.extract_slice %xv[{{ "0, " if multi }}0, {{ h }}, 0] [{{ m ~ ", " if multi }}{{ groups }}, 1, {{ lanes }}] [{{ "1, " if multi }}1, 1, 1] : !x_tile to !x_half
{% endfor %}
{% if widen_scales %}
{% for s in scale_names %}
  {{ s }}_f32_h = flow.tensor.bitcast {{ s }} : !scales -> !scale_bits
  {{ s }}_f32_bits = tensor.collapse_shape {{ s }}_f32_h [[0, 1]] : !scale_bits into !flat_bits
{% endfor %}
  %scales_f32_flat{{ ", %mins_f32_flat" if has_min }} = flow.dispatch @{{ widen_scales }}_exe::@{{ widen_scales }}(%scales_f32_bits{{ ", %mins_f32_bits" if has_min }}) : (!flat_bits{{ ", !flat_bits" if has_min }}) -> (!flat_f32{{ ", !flat_f32" if has_min }})
{% for s in scale_names %}
  {{ s }}_f32 = tensor.expand_shape {{ s }}_f32_flat [[0, 1]] output_shape [{{ n }}, {{ groups }}] : !flat_f32 into !read_scales
{% endfor %}
{% endif %}
  %zero = arith.constant 0.0 : f32
  %part_empty = tensor.empty() : !part
  %part_init = linalg.fill ins(%zero : f32) outs(%part_empty : !part) -> !part
  %part = linalg.generic {indexing_maps = [{{ x_map }}, {{ x_map }}, {{ code_map }}{{ ", " ~ code_map if fmt != "q4" }}{% for s in scale_names %}, affine_map<({{ dims }}) -> (r, g)>{% endfor %}, affine_map<({{ dims }}) -> ({{ batch }}r, l)>], iterator_types = [{{ '"parallel", ' if multi }}"parallel", "parallel", "reduction"]}
      ins(%xa, %xb, {{ "%qb" if fmt == "q4" else "%q0, %q1" }}{% for s in scale_names %}, {{ s }}{{ "_f32" if widen_scales }}{% endfor %} : !x_half, !x_half, {{ "!code_half" if fmt == "q4" else "!code_half, !code_half" }}{% for s in scale_names %}, !read_scales{% endfor %}) outs(%part_init : !part) attrs = {compilation_info = #iree_codegen.compilation_info<lowering_config = #iree_cpu.lowering_config<distribution = {{ distribution }}, vector_common_parallel = {{ parallel }}, vector_reduction = {{ reduction }}>, translation_info = #iree_codegen.translation_info<pipeline = #iree_cpu.pipeline<DoubleTilingExpert>>>} {
    ^bb0(%xa_: f32, %xb_: f32, %b0: i8{{ ", %b1: i8" if fmt != "q4" }}, %s: {{ read_scale_type }}{{ ", %mn: " ~ read_scale_type if has_min }}, %out: f32):
        %zf = arith.constant 0.0 : f32
{% if fmt == "q4" %}
        %c15 = arith.constant 15 : i8
        %c4 = arith.constant 4 : i8
        %lo8 = arith.andi %b0, %c15 : i8
        %hi8 = arith.shrui %b0, %c4 : i8
        %lo = arith.uitofp %lo8 : i8 to f32
        %hi = arith.uitofp %hi8 : i8 to f32
{% else %}
        %lo = arith.sitofp %b0 : i8 to f32
        %hi = arith.sitofp %b1 : i8 to f32
{% endif %}
{% with type = "f32", zero = "%zf", f16_type = "f16", pad = "        " %}
{% if read_scale_type == "f16" %}
{% with src = "%s", dst = "%sf" %}{% include "widen_f16.mlir" %}{% endwith %}
{% else %}
        %sf = arith.addf %s, %zf : f32
{% endif %}
{% with out = "%pa", a = "%xa_", b = "%lo", acc = none %}{% include "multiply_add.mlir" %}{% endwith %}
{% with out = "%p", a = "%xb_", b = "%hi", acc = "%pa" %}{% include "multiply_add.mlir" %}{% endwith %}
{% if has_min and read_scale_type == "f16" %}
{% with src = "%mn", dst = "%mf" %}{% include "widen_f16.mlir" %}{% endwith %}
{% elif has_min %}
        %mf = arith.addf %mn, %zf : f32
{% endif %}
{% if has_min %}
        %xs = arith.addf %xa_, %xb_ : f32
{% with out = "%mx", a = "%mf", b = "%xs", acc = none %}{% include "multiply_add.mlir" %}{% endwith %}
{% with out = "%t", a = "%sf", b = "%p", acc = "%mx" %}{% include "multiply_add.mlir" %}{% endwith %}
{% else %}
{% with out = "%t", a = "%sf", b = "%p", acc = none %}{% include "multiply_add.mlir" %}{% endwith %}
{% endif %}
{% endwith %}
        %r = arith.addf %out, %t : f32
        linalg.yield %r : f32
  } -> !part
  %empty = tensor.empty() : !acc
  %init = linalg.fill ins(%zero : f32) outs(%empty : !acc) -> !acc
  %acc = linalg.generic {indexing_maps = [affine_map<({{ batch }}r, l) -> ({{ batch }}r, l)>, affine_map<({{ batch }}r, l) -> ({{ batch }}r)>], iterator_types = [{{ '"parallel", ' if multi }}"parallel", "reduction"]}
      ins(%part : !part) outs(%init : !acc) {
    ^bb0(%v: f32, %o: f32):
        %u = arith.addf %o, %v : f32
        linalg.yield %u : f32
  } -> !acc
{% if multi %}
  %y2 = tensor.cast %acc : !acc to !y_rows
{% else %}
  %y2 = tensor.expand_shape %acc [[0, 1]] output_shape [1, {{ n }}] : !acc into !y_rows
{% endif %}
{% with pad = "  " %}
{% include "qlinear_y_rows.mlir" %}
{% endwith %}
  util.return %y : !y_tensor
}
