{# dst = src (f16, or a vector of f16 of type `f16_type`) as f32, exactly: arith.extf where the CPU
   converts f16 in hardware (`f16`), else the integer form of f16_bits_to_f32.mlir. #}
{% if f16 %}
{{ pad }}{{ dst }} = arith.extf {{ src }} : {{ f16_type }} to {{ f16_type | replace("f16", "f32") }}
{% else %}
{{ pad }}{{ dst }}_h = arith.bitcast {{ src }} : {{ f16_type }} to {{ f16_type | replace("f16", "i16") }}
{% with src=dst ~ "_h", i16_type=f16_type | replace("f16", "i16") %}
{% include "f16_bits_to_f32.mlir" %}
{% endwith %}
{% endif %}
