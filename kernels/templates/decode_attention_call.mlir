{# The util.func @name(q, k, v, pos) -> out that a decode attention site calls: decode_attention.mlir's
   dispatch, then decode_attention_combine.mlir's over its splits; the scratch result is dropped.
   With `write`: @name(q, k, v, k_new, v_new, pos, n_valid) -> (out, k', v'), the caches updated in place
   (results tied to the operands). Parameters as decode_attention.mlir's. #}
!q_tensor = tensor<{{ batch }}x{{ q_heads }}x1x{{ head_dim }}x{{ q_type }}>
!kv_tensor = tensor<{{ batch }}x{{ kv_heads }}x{{ slots }}x{{ head_dim }}x{{ cache_type }}>
!new_tensor = tensor<{{ batch }}x{{ kv_heads }}x1x{{ head_dim }}x{{ new_type }}>
!pos_tensor = tensor<{{ batch }}xi64>
!scratch_tensor = tensor<{{ batch * q_heads }}x{{ length }}xf32>
!part_tensor = tensor<{{ splits }}x{{ batch }}x{{ q_heads }}x{{ head_dim }}xf32>
!stat_tensor = tensor<{{ splits }}x{{ batch }}x{{ q_heads }}xf32>
{% if write %}
util.func private @{{ name }}(%q: !q_tensor, %k: !kv_tensor, %v: !kv_tensor, %kn: !new_tensor, %vn: !new_tensor, %pos: !pos_tensor, %nv: !pos_tensor) -> (!q_tensor, !kv_tensor, !kv_tensor) {
  %part, %m, %z, %scratch, %k2, %v2 = flow.dispatch @{{ name }}_exe::@{{ name }}(%q, %k, %v, %kn, %vn, %pos, %nv) : (!q_tensor, !kv_tensor, !kv_tensor, !new_tensor, !new_tensor, !pos_tensor, !pos_tensor) -> (!part_tensor, !stat_tensor, !stat_tensor, !scratch_tensor, %k, %v)
  %out = flow.dispatch @{{ name }}_combine_exe::@{{ name }}_combine(%part, %m, %z) : (!part_tensor, !stat_tensor, !stat_tensor) -> !q_tensor
  util.return %out, %k2, %v2 : !q_tensor, !kv_tensor, !kv_tensor
}
{% else %}
util.func private @{{ name }}(%q: !q_tensor, %k: !kv_tensor, %v: !kv_tensor, %pos: !pos_tensor) -> !q_tensor {
  %part, %m, %z, %scratch = flow.dispatch @{{ name }}_exe::@{{ name }}(%q, %k, %v, %pos) : (!q_tensor, !kv_tensor, !kv_tensor, !pos_tensor) -> (!part_tensor, !stat_tensor, !stat_tensor, !scratch_tensor)
  %out = flow.dispatch @{{ name }}_combine_exe::@{{ name }}_combine(%part, %m, %z) : (!part_tensor, !stat_tensor, !stat_tensor) -> !q_tensor
  util.return %out : !q_tensor
}
{% endif %}
