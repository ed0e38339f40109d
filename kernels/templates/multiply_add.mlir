{# out = a * b + acc in `type`: one math.fma where the CPU has FMA (`fma`), else a multiply and an add;
   acc none: a * b + 0 (the FMA form's `zero`), a plain multiply without FMA. Each line starts with `pad`. #}
{% if fma %}
{{ pad }}{{ out }} = math.fma {{ a }}, {{ b }}, {{ acc or zero }} : {{ type }}
{% elif acc is none %}
{{ pad }}{{ out }} = arith.mulf {{ a }}, {{ b }} : {{ type }}
{% else %}
{{ pad }}{{ out }}_mul = arith.mulf {{ a }}, {{ b }} : {{ type }}
{{ pad }}{{ out }} = arith.addf {{ out }}_mul, {{ acc }} : {{ type }}
{% endif %}
