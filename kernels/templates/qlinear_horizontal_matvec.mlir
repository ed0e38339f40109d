{# One activation row in one generic that reads the codes, each vector step reduced horizontally
   (kernels/qlinear.py, `horizontal_matvec_mlir`, says where it is used): y[r] = sum over the row's
   codes of x * (s * q (+ min)). The codes are read split by half group, code h * g/2 + b of a group at
   (b, h) of the q4 nibbles (the bytes bitcast to i4: byte b's low nibble at h = 0, its high one at
   h = 1, ggml's order) or at (h, b) of the q8 / widened q5 bytes, as they lie. Parameters: name, the
   shape's fields (fmt, group, groups, scale_type, has_min, x_shape, m = 1, n, k, stored_codes),
   distribution, parallel and reduction (the tiles), f16 (the CPU converts f16 in hardware). #}
{% set half = group // 2 %}
{% set dims = "r, g, b, h" %}
!x_tensor = tensor<{{ x_shape | join("x") }}xf32>
!y_tensor = tensor<{{ ((x_shape[:-1] | list) + [n]) | join("x") }}xf32>
!stored_codes = tensor<{{ stored_codes | join("x") }}xi8>
!codes = tensor<{{ n }}x{{ k // 2 if fmt == "q4" else k }}xi8>
!scales = tensor<{{ n }}x{{ groups }}x{{ scale_type }}>
{% if fmt == "q4" %}
!code_bytes = tensor<{{ n }}x{{ groups }}x{{ half }}xi8>
!code_tile = tensor<{{ n }}x{{ groups }}x{{ half }}x2xi4>
{% else %}
!code_tile = tensor<{{ n }}x{{ groups }}x2x{{ half }}xi8>
{% endif %}
!x_rows = tensor<1x{{ k }}xf32>
!x_row = tensor<{{ k }}xf32>
!x_tile = tensor<{{ groups }}x2x{{ half }}xf32>
!y_row = tensor<{{ n }}xf32>
!y_rows = tensor<1x{{ n }}xf32>
util.func private @{{ name }}(%x: !x_tensor, {{ "%codes_q5" if fmt == "q5" else "%codes" }}: !stored_codes, %scales: !scales{{ ", %mins: !scales" if has_min }}) -> !y_tensor {
{% if fmt == "q5" %}
{% with pad = "  " %}
{% include "qlinear_widen_q5.mlir" %}
{% endwith %}
{% endif %}
{% if fmt == "q4" %}
  %c3 = tensor.expand_shape %codes [[0], [1, 2]] output_shape [{{ n }}, {{ groups }}, {{ half }}] : !codes into !code_bytes
  %qw = flow.tensor.bitcast %c3 : !code_bytes -> !code_tile
{% set code_map = "affine_map<(" ~ dims ~ ") -> (r, g, b, h)>" %}
{% else %}
  %qw = tensor.expand_shape %codes [[0], [1, 2, 3]] output_shape [{{ n }}, {{ groups }}, 2, {{ half }}] : !codes into !code_tile
{% set code_map = "affine_map<(" ~ dims ~ ") -> (r, g, h, b)>" %}
{% endif %}
{% with pad = "  " %}
{% include "qlinear_x_rows.mlir" %}
{% endwith %}
  %x1 = tensor.collapse_shape %x2 [[0, 1]] : !x_rows into !x_row
  %xv = tensor.expand_shape %x1 [[0, 1, 2]] output_shape [{{ groups }}, 2, {{ half }}] : !x_row into !x_tile
  %zero = arith.constant 0.0 : f32
  %acc_empty = tensor.empty() : !y_row
  %acc_init = linalg.fill ins(%zero : f32) outs(%acc_empty : !y_row) -> !y_row
  %acc = linalg.generic {indexing_maps = [affine_map<({{ dims }}) -> (g, h, b)>, {{ code_map }}, affine_map<({{ dims }}) -> (r, g)>{{ ", affine_map<(" ~ dims ~ ") -> (r, g)>" if has_min }}, affine_map<({{ dims }}) -> (r)>], iterator_types = ["parallel", "reduction", "reduction", "reduction"]}
      ins(%xv, %qw, %scales{{ ", %mins" if has_min }} : !x_tile, !code_tile, !scales{{ ", !scales" if has_min }}) outs(%acc_init : !y_row) attrs = {compilation_info = #iree_codegen.compilation_info<lowering_config = #iree_cpu.lowering_config<distribution = {{ distribution }}, vector_common_parallel = {{ parallel }}, vector_reduction = {{ reduction }}>, translation_info = #iree_codegen.translation_info<pipeline = #iree_cpu.pipeline<DoubleTilingExpert>>>} {
{% if fmt == "q4" %}
    ^bb0(%a: f32, %q: i4, %s: {{ scale_type }}{{ ", %mn: " ~ scale_type if has_min }}, %out: f32):
        %qi = arith.extui %q : i4 to i32
        %qf = arith.uitofp %qi : i32 to f32
{% else %}
    ^bb0(%a: f32, %q: i8, %s: {{ scale_type }}{{ ", %mn: " ~ scale_type if has_min }}, %out: f32):
        %qf = arith.sitofp %q : i8 to f32
{% endif %}
{% with pad = "        " %}
{% include "qlinear_scale_code.mlir" %}
{% endwith %}
        %p = arith.mulf %a, {{ "%w" if has_min else "%w0" }} : f32
        %r = arith.addf %out, %p : f32
        linalg.yield %r : f32
  } -> !y_row
  %y2 = tensor.expand_shape %acc [[0, 1]] output_shape [1, {{ n }}] : !y_row into !y_rows
{% with pad = "  " %}
{% include "qlinear_y_rows.mlir" %}
{% endwith %}
  util.return %y : !y_tensor
}
