{# %codes [n, k] (one byte per code, 0..31, in k order) from %codes_q5, q5's stored planes: k/2 bytes
   of nibbles, then k/8 of fifth bits. Code h * g/2 + c * 8 + t of a group is nibble h of its nibble
   byte c * 8 + t, plus bit t of its fifth-bit byte h * g/16 + c: with the code index split as
   (h, c, t) every read is an affine map. The float kernels include it and then read q5 codes as they
   read q8 ones: the portable form, which copies the planes apart and writes the widened codes each
   call (the pinned IREE fuses neither into the kernel's dispatch; reading the planes in place crashes
   the compiler). The int8 kernels read the planes as they lie; where a bundle would run the float
   kernels at every step, the quantize-weights pass widens the codes once instead
   (docs/quantization.md). Parameters: n, k, groups, group; each line starts with `pad`. #}
{% set half = group // 2 %}
{% set stored_t = "tensor<" ~ n ~ "x" ~ (k // 2 + k // 8) ~ "xi8>" %}
{% set lo_t = "tensor<" ~ n ~ "x" ~ k // 2 ~ "xi8>" %}
{% set hi_t = "tensor<" ~ n ~ "x" ~ k // 8 ~ "xi8>" %}
{% set lo4_t = "tensor<" ~ n ~ "x" ~ groups ~ "x" ~ half // 8 ~ "x8xi8>" %}
{% set hi4_t = "tensor<" ~ n ~ "x" ~ groups ~ "x2x" ~ half // 8 ~ "xi8>" %}
{% set out_t = "tensor<" ~ n ~ "x" ~ groups ~ "x2x" ~ half // 8 ~ "x8xi8>" %}
{% set dims = "n, g, h, c, t" %}
{{ pad }}%q5lo = tensor.extract_slice %codes_q5[0, 0] [{{ n }}, {{ k // 2 }}] [1, 1] : {{ stored_t }} to {{ lo_t }}
{{ pad }}%q5hi = tensor.extract_slice %codes_q5[0, {{ k // 2 }}] [{{ n }}, {{ k // 8 }}] [1, 1] : {{ stored_t }} to {{ hi_t }}
{{ pad }}%q5lo4 = tensor.expand_shape %q5lo [[0], [1, 2, 3]] output_shape [{{ n }}, {{ groups }}, {{ half // 8 }}, 8] : {{ lo_t }} into {{ lo4_t }}
{{ pad }}%q5hi4 = tensor.expand_shape %q5hi [[0], [1, 2, 3]] output_shape [{{ n }}, {{ groups }}, 2, {{ half // 8 }}] : {{ hi_t }} into {{ hi4_t }}
{{ pad }}%q5empty = tensor.empty() : {{ out_t }}
{{ pad }}%q5w = linalg.generic {indexing_maps = [affine_map<({{ dims }}) -> (n, g, c, t)>, affine_map<({{ dims }}) -> (n, g, h, c)>, affine_map<({{ dims }}) -> ({{ dims }})>], iterator_types = ["parallel", "parallel", "parallel", "parallel", "parallel"]}
{{ pad }}    ins(%q5lo4, %q5hi4 : {{ lo4_t }}, {{ hi4_t }}) outs(%q5empty : {{ out_t }}) {
{{ pad }}  ^bb0(%nb: i8, %fb: i8, %o: i8):
{{ pad }}      %h = linalg.index 2 : index
{{ pad }}      %t = linalg.index 4 : index
{{ pad }}      %h8 = arith.index_cast %h : index to i8
{{ pad }}      %t8 = arith.index_cast %t : index to i8
{{ pad }}      %c4 = arith.constant 4 : i8
{{ pad }}      %c1 = arith.constant 1 : i8
{{ pad }}      %c15 = arith.constant 15 : i8
{{ pad }}      %sh = arith.muli %h8, %c4 : i8
{{ pad }}      %nib0 = arith.shrui %nb, %sh : i8
{{ pad }}      %nib = arith.andi %nib0, %c15 : i8
{{ pad }}      %bit0 = arith.shrui %fb, %t8 : i8
{{ pad }}      %bit = arith.andi %bit0, %c1 : i8
{{ pad }}      %fifth = arith.shli %bit, %c4 : i8
{{ pad }}      %q = arith.ori %nib, %fifth : i8
{{ pad }}      linalg.yield %q : i8
{{ pad }}} -> {{ out_t }}
{{ pad }}%codes = tensor.collapse_shape %q5w [[0], [1, 2, 3, 4]] : {{ out_t }} into tensor<{{ n }}x{{ k }}xi8>
