"""The default run's share of the largest case sweeps; the rest is the ``exhaustive`` tier.

Most of the suite's time is XLA compiling programs (``pytest --compile-report``), and a few
sweeps compile one or more programs per case: every mask kind through each kernel in Pallas
interpret mode, every rule against a formula, every cache layout. Run as the README says
(``python -m pytest``), the suite takes the cases named below from each sweep listed here:
cases chosen so that together they still reach every code path the sweep exists for (the
hardest mixed cases, each axis's values where the sweep has several axes). The other cases
are marked ``exhaustive`` and deselected (pytest's summary counts them). CI runs them as a
second command, so every case still runs on every change:

    python -m pytest -m exhaustive   # the rest of each sweep
    python -m pytest -m ""           # everything in one run

A sweep named on the command line (``tests/test_flex.py::test_...``, with or without a case
id) runs the cases named, whatever this file keeps.

A sweep not listed here runs whole in the default run. The keys are ``file::test`` and the
values the test ids of the cases kept, as pytest prints them; a case renamed or dropped from
a sweep while still listed here fails collection (tests/conftest.py checks).
"""

from __future__ import annotations

DEFAULT: dict[str, tuple[str, ...]] = {
  # Every mask kind through flex's three kernels, forward and backward. Kept: rows left empty
  # at the start (EMPTY tiles first in a row), a per-batch-row array (prefix lengths), a
  # function of all four indices, and &, | and ~ together. Every kind's mask is also checked
  # against its formula (test_masks.py), and cases.mask_kinds' inside a kernel (test_in_kernel.py).
  "test_flex.py::test_every_mask_kind_matches_xla_values_lse_and_gradients": (
    "causal_empty_rows",
    "prefix_lm",
    "from_fn",
    "combined",
  ),
  "test_flex.py::test_gradients_match_autodiff_of_xla": (
    "causal_lengths_custom_gqa",
    "window_or_dense",
  ),
  "test_flex.py::test_forward_matches_xla_values_and_lse": (
    "causal_lengths_alibi_gqa",
    "window_or_dense_relative",
  ),
  # The gradient summed over a broadcast key-padding row and a per-query column; a full
  # (B, N, T, S) bias's gradient is test_empty_rows_take_no_gradient_from_their_lse_cotangent's.
  "test_flex.py::test_bias_of_each_broadcast_shape_and_its_gradient_match_xla": (
    "(2, 1, 1, 40)",
    "(40, 1)",
  ),
  # Splash: documents with causal and both lengths (a batch row left empty), and the masks
  # splash tabulates.
  "test_splash.py::test_splash_matches_xla_values_lse_and_gradients": (
    "docs_and_lengths",
    "tabulated",
  ),
  "test_sharding_explicit.py::test_attention_keeps_batch_and_head_sharding": (
    "segment_ids-blockwise",
    "lengths-xla",
  ),
  # Both sharding modes, each with one of the two device counts.
  "test_sharded_kernels.py::test_splash_runs_each_devices_share": ("explicit-2", "auto-1"),
  # Every bias shape, score function, head grouping, tile shape, dtype and dropout setting
  # of the sweep appears in at least one of these (in the whole sweep, at least twice).
  "test_blockwise.py::test_every_mask_against_float64_formula": (
    "causal",
    "causal_empty_rows",
    "causal_bottom_right",
    "window",
    "lengths_empty_rows",
    "from_fn",
    "combined",
    "bigbird",
  ),
  "test_attention.py::test_matches_jax_nn": (
    "mqa_causal_cross-f32",
    "everything-f32",
    "everything-bf16",
  ),
  "test_attention.py::test_integer_bias_is_promoted_as_jax_nn_promotes_it": (
    "i32-autodiff",
    "i32-custom_vjp",
    "i32-blockwise",
    "u8-default",
  ),
  "test_attention.py::test_unbatched_layout_and_vmap": ("unbatched-blockwise", "vmapped-autodiff"),
  "test_numerics.py::test_empty_rows_give_zeros_and_no_nan_or_inf": (
    "causal_offset-autodiff",
    "strided_short_keys-custom_vjp",
    "kv_lengths_zero-custom_vjp",
    "segments-autodiff",
    "fn-autodiff",
    "bias_and_cap-custom_vjp",
  ),
  "test_xla.py::test_both_rules_match_autodiff_of_plain_reference": (
    "causal_empty_rows",
    "segments",
    "from_fn",
    "combined",
  ),
  "test_xla.py::test_check_grads_float64": ("lengths_empty_rows", "combined"),
  "test_sinks_value_dim.py::test_every_rule_matches_the_formula_with_gradients": (
    "xla-autodiff-mha-sinks",
    "xla-custom_vjp-gqa-hv5-sinks",
    "blockwise-custom_vjp-gqa-hv5-no-sinks",
  ),
  "test_scores.py::test_score_fn_computing_in_a_narrow_dtype": (
    "float16-blockwise",
    "bfloat16-custom_vjp",
  ),
  "test_parallel.py::test_ring_matches_formula": ("contiguous-False", "zigzag-True"),
  # A soft cap through the ring's pairs: the default as traced for a TPU (where splash pairs
  # once ran, with wrong gradients) in the zig-zag layout, and splash's refusal (no kernel
  # runs) in every layout. Each case draws its masking, shapes and cap.
  "test_adversarial_paths.py::test_soft_cap_through_every_ring_pair_kernel": (
    "default_on_tpu-zigzag",
    "splash-contiguous",
    "splash-zigzag",
    "splash-striped",
  ),
  # Masks reading arrays: flex (run where it takes the mask, else refused by name), the
  # default traced for a GPU (flex only where it lowers) and splash's refusal.
  "test_adversarial_paths.py::test_masks_reading_arrays_match_xla_or_are_refused_by_name": (
    "flex",
    "default_on_gpu",
    "splash",
  ),
  # Ring inputs placed every way: Explicit axes, where shard_map refused them.
  "test_adversarial_paths.py::test_ring_takes_inputs_in_every_placement": ("explicit",),
  # Refused derivatives (traced and lowered, nothing runs) of the fused kernels, and forward
  # mode through every custom_vjp rule; the rules' supported second derivatives run in the rest.
  "test_adversarial_paths.py::test_derivatives_a_rule_cannot_take_raise_its_error_on_every_path": (
    "xla/custom_vjp-forward_mode",
    "blockwise-forward_mode",
    "flex-second_order",
    "flex-forward_mode",
    "splash-second_order",
    "splash-forward_mode",
    "ring/blockwise-forward_mode",
  ),
  "test_decode.py::test_prefill_chunks_and_decode_steps_equal_full_causal": (
    "mha-xla",
    "gqa-blockwise",
  ),
  "test_decode.py::test_overflow_under_jit_dropped_tokens_queries_return_zeros": (
    "xla-outside_jit",
    "blockwise-inside_jit",
    "int8-inside_jit",
  ),
  "test_paged.py::test_paged_equals_contiguous_equals_full_causal": ("steps-gqa", "prefill-mqa"),
  "test_paged.py::test_running_out_of_pages_under_jit_dropped_tokens_queries_return_zeros": (
    "float32-inside_jit",
    "int8-outside_jit",
  ),
  "test_linen_decode.py::test_decode_equals_full_causal": ("gqa_rope_chunked", "gqa_rope_prefill"),
  "test_nnx_decode.py::test_prefill_and_decode_equal_full_causal_attention": (
    "4-chunks0",
    "2-chunks3",
  ),
  "test_nnx.py::test_adapter_matches_flax_default": (
    "causal-plain",
    "gqa-plain",
    "padding_mask-blockwise",
    "self-custom_vjp",
  ),
  "test_in_kernel.py::test_every_score_function_is_exact_inside_a_kernel_and_lowers_to_triton": (
    "relative",
    "custom",
  ),
  "test_dropout.py::test_broadcast_dropout_shares_one_pattern_across_batch_and_heads": (
    "custom_vjp",
    "blockwise",
  ),
}
