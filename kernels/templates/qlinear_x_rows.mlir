{# %x2: a qlinear's activation %x (x_shape, [..., k]) as its m rows, [m, k]. Each line starts with `pad`. #}
{% set lead = x_shape | length - 1 %}
{% set x_t = "tensor<" ~ x_shape | join("x") ~ "xf32>" %}
{% set x2_t = "tensor<" ~ m ~ "x" ~ k ~ "xf32>" %}
{% if lead == 0 %}
{{ pad }}%x2 = tensor.expand_shape %x [[0, 1]] output_shape [1, {{ k }}] : {{ x_t }} into {{ x2_t }}
{% elif lead == 1 %}
{{ pad }}%x2 = tensor.cast %x : {{ x_t }} to {{ x2_t }}
{% else %}
{{ pad }}%x2 = tensor.collapse_shape %x [{{ range(lead) | list }}, [{{ lead }}]] : {{ x_t }} into {{ x2_t }}
{% endif %}
