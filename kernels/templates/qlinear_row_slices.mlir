{# %y1 [m*n] from %x1 [m*x_len] (and %r1 [m*n] with `residual`) in slices of `rows` rows, where the rows'
   stack does not fit one dispatch: slice i's dispatch (`dispatches[i]`, one line reading %xs{i} (and
   %rs{i}) and defining %ys{i}) put into the result in row order. #}
!x_tensor = tensor<{{ m * x_len }}xf32>
!y_tensor = tensor<{{ m * n }}xf32>
!xs_tensor = tensor<{{ rows * x_len }}xf32>
!ys_tensor = tensor<{{ rows * n }}xf32>
%ye = tensor.empty() : !y_tensor
{% for dispatch in dispatches %}
{% set i = loop.index0 %}
%xs{{ i }} = tensor.extract_slice %x1[{{ i * rows * x_len }}] [{{ rows * x_len }}] [1] : !x_tensor to !xs_tensor
{% if residual %}
%rs{{ i }} = tensor.extract_slice %r1[{{ i * rows * n }}] [{{ rows * n }}] [1] : !y_tensor to !ys_tensor
{% endif %}
{{ dispatch }}
{{ "%y1" if loop.last else "%ya" ~ i }} = tensor.insert_slice %ys{{ i }} into {{ "%ye" if loop.first else "%ya" ~ (i - 1) }}[{{ i * rows * n }}] [{{ rows * n }}] [1] : !ys_tensor into !y_tensor
{% endfor %}
