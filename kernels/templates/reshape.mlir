{# The right-hand side of a reshape of `src` (`src_type`) to `dst_type`: op "expand" (to `shape`) or
   "collapse", `groups` the reassociation (the source dims each result dim takes, or the reverse). #}
{% if op == "expand" %}
tensor.expand_shape {{ src }} {{ groups }} output_shape {{ shape }} : {{ src_type }} into {{ dst_type }}
{% else %}
tensor.collapse_shape {{ src }} {{ groups }} : {{ src_type }} into {{ dst_type }}
{% endif %}
