{# `result` (`results` values: `result`#0, ...) = a hand-written executable's dispatch on `operands`
   of `types`: the call a kernel's util.func makes to the stream.executable @`name`_exe exports. #}
{{ result }}{% if result_types | length > 1 %}:{{ result_types | length }}{% endif %} = flow.dispatch @{{ name }}_exe::@{{ name }}({{ operands | join(", ") }}) : ({{ types | join(", ") }}) -> {% if result_types | length > 1 %}({{ result_types | join(", ") }}){% else %}{{ result_types[0] }}{% endif %}
