{# dst = the f16 values whose bits src holds (i16, or a vector of i16 of type `i16_type`) as f32, exactly,
   in integer and f32 instructions only (a CPU without F16C): the exponent rebiased from 15 to 127 for
   normal numbers and infinities or NaNs (31 to 255), a subnormal's mantissa m read as m * 2^-24 (exact:
   m < 1024, and the product is a normal f32); the sign on top. Each line starts with `pad`. #}
{% set i32 = i16_type | replace("i16", "i32") %}
{% set f32 = i16_type | replace("i16", "f32") %}
{% set i1 = i16_type | replace("i16", "i1") %}
{% macro constant(value, type) %}arith.constant {% if type.startswith("vector<") %}dense<{{ value }}>{% else %}{{ value }}{% endif %} : {{ type }}{% endmacro %}
{% set p = dst %}
{{ pad }}{{ p }}_u = arith.extui {{ src }} : {{ i16_type }} to {{ i32 }}
{{ pad }}{{ p }}_c7fff = {{ constant(32767, i32) }}
{{ pad }}{{ p }}_c8000 = {{ constant(32768, i32) }}
{{ pad }}{{ p }}_c400 = {{ constant(1024, i32) }}
{{ pad }}{{ p }}_c7c00 = {{ constant(31744, i32) }}
{{ pad }}{{ p }}_c13 = {{ constant(13, i32) }}
{{ pad }}{{ p }}_c16 = {{ constant(16, i32) }}
{{ pad }}{{ p }}_rebias = {{ constant(939524096, i32) }}
{{ pad }}{{ p }}_rebias_inf = {{ constant(1879048192, i32) }}
{{ pad }}{{ p }}_tiny = {{ constant("5.9604644775390625E-8", f32) }}
{{ pad }}{{ p }}_em = arith.andi {{ p }}_u, {{ p }}_c7fff : {{ i32 }}
{{ pad }}{{ p }}_sgn0 = arith.andi {{ p }}_u, {{ p }}_c8000 : {{ i32 }}
{{ pad }}{{ p }}_sgn = arith.shli {{ p }}_sgn0, {{ p }}_c16 : {{ i32 }}
{{ pad }}{{ p }}_sh = arith.shli {{ p }}_em, {{ p }}_c13 : {{ i32 }}
{{ pad }}{{ p }}_is_inf = arith.cmpi uge, {{ p }}_em, {{ p }}_c7c00 : {{ i32 }}
{{ pad }}{{ p }}_bias = arith.select {{ p }}_is_inf, {{ p }}_rebias_inf, {{ p }}_rebias : {{ i1 }}, {{ i32 }}
{{ pad }}{{ p }}_normal = arith.addi {{ p }}_sh, {{ p }}_bias : {{ i32 }}
{{ pad }}{{ p }}_mf = arith.uitofp {{ p }}_em : {{ i32 }} to {{ f32 }}
{{ pad }}{{ p }}_subf = arith.mulf {{ p }}_mf, {{ p }}_tiny : {{ f32 }}
{{ pad }}{{ p }}_sub = arith.bitcast {{ p }}_subf : {{ f32 }} to {{ i32 }}
{{ pad }}{{ p }}_is_sub = arith.cmpi ult, {{ p }}_em, {{ p }}_c400 : {{ i32 }}
{{ pad }}{{ p }}_mag = arith.select {{ p }}_is_sub, {{ p }}_sub, {{ p }}_normal : {{ i1 }}, {{ i32 }}
{{ pad }}{{ p }}_bits = arith.ori {{ p }}_mag, {{ p }}_sgn : {{ i32 }}
{{ pad }}{{ dst }} = arith.bitcast {{ p }}_bits : {{ i32 }} to {{ f32 }}
