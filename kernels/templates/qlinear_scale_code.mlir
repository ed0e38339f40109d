{# The weight of one code in a dequantizing body: %w0 = s * %qf (the code as f32), and with a min
   %w = %w0 + min. %s (and %mn) are scale_type; f16 ones are widened first (`f16`: the CPU converts
   f16 in hardware). The weight's value is `%w` with a min, else `%w0`. Each line starts with `pad`. #}
{% if scale_type == "f16" %}
{% with src = "%s", dst = "%sf", f16_type = "f16" %}
{% include "widen_f16.mlir" %}
{% endwith %}
{{ pad }}%w0 = arith.mulf %sf, %qf : f32
{% else %}
{{ pad }}%w0 = arith.mulf %s, %qf : f32
{% endif %}
{% if has_min and scale_type == "f16" %}
{% with src = "%mn", dst = "%mf", f16_type = "f16" %}
{% include "widen_f16.mlir" %}
{% endwith %}
{{ pad }}%w = arith.addf %w0, %mf : f32
{% elif has_min %}
{{ pad }}%w = arith.addf %w0, %mn : f32
{% endif %}
