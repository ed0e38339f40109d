{# A qlinear call as a dequantization to a float [n, k] tile, then a matmul of the m activation rows
   (kernels/qlinear.py, `dequantize_matmul_mlir`, says where it is used). Parameters: name, fmt
   ("q4", "q8", or "q5", read widened to q8's bytes), group, groups, scale_type, has_min, x_shape
   ([..., k]), m, n, k, stored_codes (the codes array's dims as the bundle stores them), q4_bytes
   (q4 codes read as bytes, the nibble picked by the half index: CPU; else the i4 bitcast read
   transposed, the portable form), fma and f16 (the CPU's float operations). #}
{% set half = group // 2 %}
{% set scale_count = 2 if has_min else 1 %}
{% set dims = "n, g, h, b" %}
!x_tensor = tensor<{{ x_shape | join("x") }}xf32>
!y_tensor = tensor<{{ ((x_shape[:-1] | list) + [n]) | join("x") }}xf32>
!stored_codes = tensor<{{ stored_codes | join("x") }}xi8>
!codes = tensor<{{ n }}x{{ k // 2 if fmt == "q4" else k }}xi8>
!scales = tensor<{{ n }}x{{ groups }}x{{ scale_type }}>
{% if fmt == "q4" and q4_bytes %}
!code_tile = tensor<{{ n }}x{{ groups }}x{{ half }}xi8>
{% elif fmt == "q4" %}
!code_bytes = tensor<{{ n }}x{{ groups }}x{{ half }}xi8>
!code_tile = tensor<{{ n }}x{{ groups }}x{{ half }}x2xi4>
{% else %}
!code_tile = tensor<{{ n }}x{{ groups }}x2x{{ half }}xi8>
{% endif %}
!w_tile = tensor<{{ n }}x{{ groups }}x2x{{ half }}xf32>
!w = tensor<{{ n }}x{{ k }}xf32>
!x_rows = tensor<{{ m }}x{{ k }}xf32>
!y_rows = tensor<{{ m }}x{{ n }}xf32>
util.func private @{{ name }}(%x: !x_tensor, {{ "%codes_q5" if fmt == "q5" else "%codes" }}: !stored_codes, %scales: !scales{{ ", %mins: !scales" if has_min }}) -> !y_tensor {
{% if fmt == "q5" %}
{% with pad = "  " %}
{% include "qlinear_widen_q5.mlir" %}
{% endwith %}
{% endif %}
{% if fmt == "q4" and q4_bytes %}
  %qw = tensor.expand_shape %codes [[0], [1, 2]] output_shape [{{ n }}, {{ groups }}, {{ half }}] : !codes into !code_tile
{% set code_map = "affine_map<(" ~ dims ~ ") -> (n, g, b)>" %}
{% elif fmt == "q4" %}
  %c3 = tensor.expand_shape %codes [[0], [1, 2]] output_shape [{{ n }}, {{ groups }}, {{ half }}] : !codes into !code_bytes
  %qw = flow.tensor.bitcast %c3 : !code_bytes -> !code_tile
{% set code_map = "affine_map<(" ~ dims ~ ") -> (n, g, b, h)>" %}
{% else %}
  %qw = tensor.expand_shape %codes [[0], [1, 2, 3]] output_shape [{{ n }}, {{ groups }}, 2, {{ half }}] : !codes into !code_tile
{% set code_map = "affine_map<(" ~ dims ~ ") -> (n, g, h, b)>" %}
{% endif %}
  %wempty = tensor.empty() : !w_tile
  %w3 = linalg.generic {indexing_maps = [{{ code_map }}{% for _ in range(scale_count) %}, affine_map<({{ dims }}) -> (n, g)>{% endfor %}, affine_map<({{ dims }}) -> ({{ dims }})>], iterator_types = ["parallel", "parallel", "parallel", "parallel"]}
      ins(%qw, %scales{{ ", %mins" if has_min }} : !code_tile, !scales{{ ", !scales" if has_min }}) outs(%wempty : !w_tile) {
{% if fmt == "q4" and q4_bytes %}
    ^bb0(%q8: i8, %s: {{ scale_type }}{{ ", %mn: " ~ scale_type if has_min }}, %o: f32):
        %h = linalg.index 2 : index
        %hi = arith.index_cast %h : index to i8
        %c4 = arith.constant 4 : i8
        %c15 = arith.constant 15 : i8
        %sh = arith.muli %hi, %c4 : i8
        %nib = arith.shrui %q8, %sh : i8
        %q = arith.andi %nib, %c15 : i8
        %qf = arith.uitofp %q : i8 to f32
{% elif fmt == "q4" %}
    ^bb0(%q: i4, %s: {{ scale_type }}{{ ", %mn: " ~ scale_type if has_min }}, %o: f32):
        %qi = arith.extui %q : i4 to i32
        %qf = arith.uitofp %qi : i32 to f32
{% else %}
    ^bb0(%q: i8, %s: {{ scale_type }}{{ ", %mn: " ~ scale_type if has_min }}, %o: f32):
        %qf = arith.sitofp %q : i8 to f32
{% endif %}
{% with pad = "        " %}
{% include "qlinear_scale_code.mlir" %}
{% endwith %}
        linalg.yield {{ "%w" if has_min else "%w0" }} : f32
  } -> !w_tile
  %w = tensor.collapse_shape %w3 [[0], [1, 2, 3]] : !w_tile into !w
{% with pad = "  " %}
{% include "qlinear_x_rows.mlir" %}
{% endwith %}
  %zero = arith.constant 0.0 : f32
  %yempty = tensor.empty() : !y_rows
  %yfill = linalg.fill ins(%zero : f32) outs(%yempty : !y_rows) -> !y_rows
  %y2 = linalg.matmul indexing_maps = [affine_map<(d0, d1, d2) -> (d0, d2)>, affine_map<(d0, d1, d2) -> (d1, d2)>, affine_map<(d0, d1, d2) -> (d0, d1)>]
      ins(%x2, %w : !x_rows, !w) outs(%yfill : !y_rows) -> !y_rows
{% with pad = "  " %}
{% include "qlinear_y_rows.mlir" %}
{% endwith %}
  util.return %y : !y_tensor
}
