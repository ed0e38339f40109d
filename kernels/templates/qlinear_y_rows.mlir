{# %y: a qlinear's result rows %y2 ([m, n]) in the activation's leading shape (x_shape[:-1]), [..., n].
   Each line starts with `pad`. #}
{% set lead = x_shape | length - 1 %}
{% set y_shape = (x_shape[:-1] | list) + [n] %}
{% set y_t = "tensor<" ~ y_shape | join("x") ~ "xf32>" %}
{% set y2_t = "tensor<" ~ m ~ "x" ~ n ~ "xf32>" %}
{% if lead == 0 %}
{{ pad }}%y = tensor.collapse_shape %y2 [[0, 1]] : {{ y2_t }} into {{ y_t }}
{% elif lead == 1 %}
{{ pad }}%y = tensor.cast %y2 : {{ y2_t }} to {{ y_t }}
{% else %}
{{ pad }}%y = tensor.expand_shape %y2 [{{ range(lead) | list }}, [{{ lead }}]] output_shape {{ y_shape }} : {{ y2_t }} into {{ y_t }}
{% endif %}
