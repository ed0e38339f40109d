{# `result` = the f32 tensor `src` of `shape` as one dimension of `size` values. #}
!src_tensor = tensor<{{ shape | join("x") }}xf32>
!flat_tensor = tensor<{{ size }}xf32>
{% if shape | length == 1 %}
{{ result }} = tensor.cast {{ src }} : !src_tensor to !flat_tensor
{% else %}
{{ result }} = tensor.collapse_shape {{ src }} [{{ range(shape | length) | list }}] : !src_tensor into !flat_tensor
{% endif %}
