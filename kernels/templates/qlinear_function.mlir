{# The util.func @name(params) a qlinear site calls, around a body spelt elsewhere (the int8 kernels'
   dispatches and the reshapes about them): `lines`, one a line, then %y returned in the activation's
   leading shape. Parameters: name, params (each "%v: type"), lines, x_shape, n. #}
!y_tensor = tensor<{{ ((x_shape[:-1] | list) + [n]) | join("x") }}xf32>
util.func private @{{ name }}({{ params | join(", ") }}) -> !y_tensor {
{% for line in lines %}
  {{ line }}
{% endfor %}
  util.return %y : !y_tensor
}
