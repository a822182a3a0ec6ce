"""Which tests CI leaves to the `slow` tier, and the CI test that keeps each claim covered.

The default run (`python -m pytest`, CI) must stay under 15 minutes on a 2-core machine; the
whole matrix takes over an hour there. A test listed here is marked `slow` at collection (run
them with `pytest -m slow`); its value names the test that still proves the same claim in CI,
usually the same parity at a cheaper layout or the same mechanism in-process rather than
through a launched CLI. A key is a test node id, with or without its parameter id: without it,
every case of the test is slow. An entry that matches no test of a collected file is an error,
so a renamed test cannot silently move back into CI or out of it.

Chosen by measured time (a whole-suite run with --durations=0 on the 2-core machine), keeping
world sizes 2, 3 and 4 in CI for each kind of parallelism at its cheapest level.
"""

from __future__ import annotations

_ENTRIES: list[tuple[str, str]] = [
    # --- expert parallelism: ep 2/4 and the fine-grained preset stay in CI at cheaper layouts
    (
        "tests/train/test_expert_trainer.py::test_fine_grained_preset_at_ep_4_equals_one_process",
        "test_expert_trainer.py::test_expert_parallel_losses_equal_one_process[ep4-zero1]",
    ),
    (
        "tests/train/test_expert_trainer.py::test_capacity_routing_at_world_size_3_equals_one_process",
        "test_expert_tp_trainer.py::test_capacity_routing_with_experts_split_over_tp_equals_one_process[1]",
    ),
    (
        "tests/train/test_expert_trainer.py::test_checkpoints_reshard_across_ep[2-1]",
        "test_expert_trainer.py::test_checkpoints_reshard_across_ep[4-2]",
    ),
    (
        "tests/train/test_expert_trainer.py::test_expert_parallel_losses_equal_one_process[ep2-pp2]",
        "test_expert_parallel_losses_equal_one_process[ep2] and tests/pipeline/test_dualpipev_runtime.py",
    ),
    (
        "tests/train/test_expert_tp_trainer.py::test_world_3_tp3_whole_experts_equal_one_process",
        "tests/parallel/test_expert_tp.py::test_world_3_tp3_model_matches_one_process (world 3, model level)",
    ),
    (
        "tests/train/test_expert_tp_trainer.py::test_fine_grained_preset_tp_extend_ep_equals_one_process",
        "test_expert_tp_trainer.py::test_ep2_tp2_losses_equal_one_process[extend]",
    ),
    (
        "tests/train/test_expert_tp_trainer.py::test_checkpoint_at_ep2_tp2_resumes_in_one_process[etp2]",
        "tests/train/test_expert_trainer.py::test_checkpoints_reshard_across_ep[4-2]",
    ),
    (
        "tests/train/test_expert_tp_trainer.py::test_checkpoint_at_ep2_tp2_resumes_in_one_process[extend]",
        "tests/train/test_expert_trainer.py::test_checkpoints_reshard_across_ep[4-2]",
    ),
    (
        "tests/train/test_expert_tp_trainer.py::test_capacity_routing_with_experts_split_over_tp_equals_one_process[2]",
        "test_capacity_routing_with_experts_split_over_tp_equals_one_process[1]",
    ),
    (
        "tests/train/test_expert_tp_trainer.py::test_ep2_tp2_losses_equal_one_process[etp1-sp-zero2]",
        "test_ep2_tp2_losses_equal_one_process[etp1] and [etp2-sp-allgather]",
    ),
    (
        "tests/train/test_expert_tp_trainer.py::test_ep2_tp2_losses_equal_one_process[extend-sp-zero1]",
        "test_ep2_tp2_losses_equal_one_process[extend] and [etp2-sp-allgather]",
    ),
    (
        "tests/train/test_expert_tp_trainer.py::test_ep2_tp2_losses_equal_one_process[pp2-tp2-extend-sp]",
        "test_ep2_tp2_losses_equal_one_process[etp1]; tests/pipeline/test_dualpipev_runtime.py",
    ),
    (
        "tests/train/test_expert_tp_trainer.py::test_context_parallel_tp_extend_ep_equals_one_process",
        "test_expert_trainer.py::test_context_parallel_moe_without_router_losses_equals_one_process",
    ),
    (
        "tests/train/test_expert_replicate_trainer.py::test_replicate_hot_equals_plain_expert_parallelism[ep2-pp2]",
        "test_replicate_hot_equals_plain_expert_parallelism[ep2] and [ep4] (the metrics' pp reduction "
        "aside, the layer is the same in a pipeline stage)",
    ),
    # --- the trainer's layouts: tp 2, dp 4 (ZeRO-1/2), pp 2, dp 2 × tp 2 + sp stay in CI
    (
        "tests/train/test_trainer.py::test_first_ten_losses_equal_single_process[tp4]",
        "test_first_ten_losses_equal_single_process[tp2] and [dp4-zero1]; tests/parallel/test_tensor.py "
        "at world 4",
    ),
    (
        "tests/train/test_trainer.py::test_first_ten_losses_equal_single_process[qwen2-tp2]",
        "test_first_ten_losses_equal_single_process[tp2] and [qwen2-dp2-zero1]",
    ),
    (
        "tests/train/test_trainer.py::test_first_ten_losses_equal_single_process[moe-dp2-tp2]",
        "test_expert_tp_trainer.py::test_ep2_tp2_losses_equal_one_process",
    ),
    (
        "tests/train/test_trainer.py::test_cli_resume_without_checkpoint_is_one_clear_error",
        "tests/faults/test_checkpoints.py::test_latest_with_nothing_verifying_says_so",
    ),
    # --- context parallelism: ring, ulysses, hybrid at cp 2/3/4 stay in CI (model and trainer)
    (
        "tests/parallel/test_context.py::test_trainer_first_ten_losses_equal_single_process[cp2-tp2]",
        "test_trainer_first_ten_losses_equal_single_process[cp2-ulysses]; tests/parallel/test_tensor.py",
    ),
    (
        "tests/parallel/test_context.py::test_trainer_first_ten_losses_equal_single_process[cp2-pp2-ring]",
        "test_trainer_first_ten_losses_equal_single_process[cp2-ring]; tests/parallel/test_zero3.py [cp2]",
    ),
    (
        "tests/parallel/test_context.py::test_trainer_first_ten_losses_equal_single_process[cp2-dp2-zero1]",
        "test_trainer_first_ten_losses_equal_single_process[cp4-hybrid]",
    ),
    (
        "tests/parallel/test_context.py::test_packed_training_under_cp_equals_single_process[packed-cp4-hybrid-4-extra2]",
        "test_packed_training_under_cp_equals_single_process[packed-cp2-ring-2-extra0]; model-level "
        "packed cp 4",
    ),
    (
        "tests/parallel/test_context.py::test_packed_training_under_cp_equals_single_process[packed-cp2-ulysses-2-extra1]",
        "test_packed_training_under_cp_equals_single_process[packed-cp2-ring-2-extra0]",
    ),
    # --- checkpoints and faults: one launched run per mechanism stays in CI
    (
        "tests/faults/test_checkpoints.py::test_huge_learning_rate_stops_with_one_line_and_only_finite_checkpoints",
        "test_checkpoints.py::test_nonfinite_state_is_never_saved (in-process)",
    ),
    (
        "tests/faults/test_checkpoints.py::test_truncated_shard_in_named_checkpoint_is_an_error_naming_the_file",
        "tests/checkpoint/test_manifest_damage.py; test_checkpoints.py::test_missing_file_is_named",
    ),
    (
        "tests/faults/test_checkpoints.py::test_resume_on_other_data_is_refused_in_one_line",
        "test_checkpoints.py::test_new_run_in_used_run_dir_is_refused_with_one_line (a launched refusal)",
    ),
    (
        "tests/faults/test_signals.py::test_killed_launcher_leaves_no_worker[15]",
        "test_killed_launcher_leaves_no_worker[9]",
    ),
    (
        "tests/faults/test_peer_death.py::test_dead_peer_is_named_not_a_socket_error[ring]",
        "test_dead_peer_is_named_not_a_socket_error[native]",
    ),
    (
        "tests/faults/test_torchrun.py::test_torchrun_restart_after_a_killed_worker_finishes_the_run",
        "tests/plan/test_plan.py::test_torchrun_bad_setting_is_one_line_from_one_rank (torchrun launch); "
        "test_signals.py::test_killed_worker_is_named_with_its_signal; resume parity in test_trainer.py",
    ),
    (
        "tests/faults/test_exit_stress.py::test_short_jobs_start_and_exit_without_native_aborts",
        "tests/faults/test_run_command.py::test_plain_torch_distributed_script and every launched test "
        "(each starts and exits a job)",
    ),
    (
        "tests/faults/test_run_dir.py::test_second_run_on_a_busy_run_dir_is_one_line_naming_the_first",
        "test_checkpoints.py::test_new_run_in_used_run_dir_is_refused_with_one_line; test_run_dir.py's "
        "lock tests",
    ),
    (
        "tests/checkpoint/test_checkpoint.py::test_reshard_pipeline_stages_to_one_stage_and_back",
        "test_checkpoint.py::test_reshard_tp2_to_tp1_and_zero_dp2_to_tp2; "
        "test_pipeline_runtime.py::test_trainer_losses_and_checkpoints_across_pipeline_layouts",
    ),
    (
        "tests/interop/test_export_safety.py::test_overwrite_writes_beside_user_files_and_replaces_only_its_own",
        "test_export_safety.py::test_to_hf_never_deletes_or_replaces_files_it_did_not_write",
    ),
    (
        "tests/interop/test_export_safety.py::test_a_directory_of_its_own_files_is_replaced_whole",
        "test_export_safety.py::test_interrupted_export_leaves_the_previous_one_whole",
    ),
    (
        "tests/interop/test_export_safety.py::test_from_hf_refuses_to_replace_a_checkpoint_without_overwrite",
        "test_export_safety.py::test_to_hf_never_deletes_or_replaces_files_it_did_not_write",
    ),
    # --- ZeRO, pipeline, memory features: the same parity at the cheaper sizes
    (
        "tests/parallel/test_zero3.py::test_zero3_under_pipeline_trains_like_one_process",
        "test_zero3.py::test_trainer_losses_equal_single_process; test_pipeline_runtime.py's schedules",
    ),
    (
        "tests/parallel/test_data.py::test_bf16_keeps_fp32_masters_and_zero_shards_state",
        "tests/memory/test_fp32_reuse.py::test_bf16_training_is_bit_identical_with_shared_masters",
    ),
    (
        "tests/parallel/test_pipeline_runtime.py::test_every_schedule_matches_one_process[pp2-tp2]",
        "test_every_schedule_matches_one_process[pp2] and [pp4]",
    ),
    (
        "tests/parallel/test_pipeline_runtime.py::test_moe_pipeline_with_split_backward_matches_one_process",
        "tests/pipeline/test_dualpipev_runtime.py::test_moe_overlap_is_exact_and_hands_over",
    ),
    (
        "tests/parallel/test_tp_overlap.py::test_trainer_losses_with_overlap_equal_single_process",
        "test_tp_overlap.py::test_overlapped_model_matches_single_device[2-4]",
    ),
    (
        "tests/memory/test_recompute.py::test_recompute_tensor_parallel_exact[4]",
        "test_recompute_tensor_parallel_exact[2]; tests/memory/test_trainer_recompute.py",
    ),
    (
        "tests/memory/test_chunked_loss.py::test_chunked_loss_vocab_parallel[4]",
        "test_chunked_loss_vocab_parallel[2]; tests/memory/test_trainer_chunked_loss.py",
    ),
    (
        "tests/memory/test_estimate.py::test_estimate_matches_count_tensor_parallel[3]",
        "test_estimate_matches_count_tensor_parallel[2]; tests/memory/test_estimate_counted.py",
    ),
    (
        "tests/memory/test_estimate_counted.py::"
        "test_zero_state_under_cp_is_sharded_over_dp_times_cp[ZeRO-1 cp2]",
        "tests/memory/test_estimate_cp_columns.py::test_every_column_of_the_estimate_under_cp (all columns)",
    ),
    # --- sparsity: the 2:4 parity, packing and the async update stay in CI once each
    (
        "tests/train/test_sparsity.py::test_resumed_sparse_run_equals_uninterrupted_run",
        "tests/train/test_sparsity_comm.py::test_resume_keeps_the_packing_decision_and_an_async_update",
    ),
    (
        "tests/train/test_sparsity.py::test_tp2_sparse_run_matches_single_process_and_masks_agree[moe-2:4-srste]",
        "test_tp2_sparse_run_matches_single_process_and_masks_agree[tiny-2:4]",
    ),
    (
        "tests/train/test_sparsity.py::test_tp2_sparse_run_matches_single_process_and_masks_agree[tiny-rigl]",
        "test_tp2_sparse_run_matches_single_process_and_masks_agree[tiny-2:4]",
    ),
    (
        "tests/train/test_sparsity_async.py::test_checkpoint_with_an_update_in_flight_resumes_exactly",
        "tests/train/test_sparsity_comm.py::test_resume_keeps_the_packing_decision_and_an_async_update",
    ),
    (
        "tests/train/test_sparsity_async.py::test_async_losses_equal_at_dp1_and_dp2_tp2",
        "test_sparsity_async.py::test_async_is_sync_installed_one_step_later; "
        "test_sparsity_comm.py::test_resume_keeps_the_packing_decision_and_an_async_update (dp 2)",
    ),
    (
        "tests/train/test_sparsity_comm.py::test_trainer_losses_equal_dense_communication_and_bytes_are_n_over_m[dp2-zero1]",
        "[dp2-zero2] of the same test",
    ),
    (
        "tests/train/test_sparsity_comm.py::test_trainer_losses_equal_dense_communication_and_bytes_are_n_over_m[moe-dp4-ep2-zero1]",
        "[moe-dp2-zero1] of the same test",
    ),
    # --- compile, generate, bench, plan: one launched or compiled run each
    (
        "tests/train/test_compile.py::test_compiled_losses_equal_eager_tp2",
        "test_compile.py::test_compiled_losses_equal_eager_one_process",
    ),
    (
        "tests/infer/test_parallel_generate.py::test_layouts_equal_single_process[tp2xdp2]",
        "test_layouts_equal_single_process[tp2] and [dp2]",
    ),
    (
        "tests/infer/test_cli_generate.py::test_pipeline_generation_of_an_untied_model_equals_one_process",
        "tests/infer/test_parallel_generate.py::test_layouts_equal_single_process[pp2]",
    ),
    (
        "tests/test_cli_bench.py::test_bench_comm_under_torchrun",
        "test_cli_bench.py::test_bench_comm_spawned_checks_plots_and_fits",
    ),
    (
        "tests/plan/test_plan.py::test_the_run_records_its_plan_in_meta_json",
        "tests/plan/test_plan.py's dry-run JSON tests (the same plan, printed)",
    ),
    # --- a second cut (measured again with pools that keep their groups): one launched run per
    # mechanism, and the trainer-level matrices at a few layouts covering world sizes 2, 3 and 4
    (
        "tests/train/test_eval.py::test_eval_equals_the_trainers_validation_loss",
        "tests/infer/test_cli_generate.py::test_meshspeed_checkpoint_equals_hf (a trained checkpoint read"
        " back); test_eval.py::test_eval_of_something_that_is_not_a_checkpoint_is_one_line",
    ),
    (
        "tests/faults/test_root_cause.py::test_stopped_rank_is_named_as_the_root_cause",
        "tests/comm/test_desync.py::test_missing_rank_is_named_native_path and [debug mode]: the same "
        "diagnosis in-process",
    ),
    (
        "tests/parallel/test_fused_adamw.py::test_every_zero_stage_and_memory_feature_trains_the_same_bits_with_the_kernel",
        "test_fused_adamw.py's kernel-against-reference tests; "
        "test_clip_whole_grads_leaves_zero1_buckets_as_one_process_would",
    ),
    (
        "tests/interop/test_export_safety.py::test_interrupted_export_leaves_the_previous_one_whole",
        "test_export_safety.py::test_to_hf_never_deletes_or_replaces_files_it_did_not_write",
    ),
    (
        "tests/train/test_trainer.py::test_resumed_run_equals_uninterrupted_run",
        "tests/parallel/test_context.py::test_cp_checkpoint_resumes_without_cp (resume across layouts); "
        "test_sparsity_comm.py::test_resume_keeps_the_packing_decision_and_an_async_update",
    ),
    (
        "tests/test_cli_bench.py::test_bench_comm_spawned_checks_plots_and_fits",
        "tests/comm/test_collectives.py (the collectives); test_cli_bench.py's bad-input tests",
    ),
    (
        "tests/kernels/test_choose.py::test_trainer_with_fused_kernels_equals_reference",
        "tests/kernels/test_rope_add_norm.py::test_model_with_every_triton_site_matches_reference_model; "
        "test_choose.py's unit tests",
    ),
    (
        "tests/faults/test_signals.py::test_error_on_one_rank_ends_every_rank",
        "tests/faults/test_run_command.py (a rank that raises ends the job, no worker left)",
    ),
    (
        "tests/kernels/test_gpu_report.py::test_cuda_path_selection_keeps_the_tests_that_name_cuda",
        "test_gpu_report.py::test_dry_lists_every_step_of_a_gpu_run",
    ),
    (
        "tests/parallel/test_zero_overlap.py::test_trainer_losses_with_prefetch_equal_single_process",
        "test_zero_overlap.py::test_prefetched_gather_equals_blocking_gather",
    ),
    (
        "tests/interop/test_cuda_convert.py::test_convert_round_trip_leaves_the_gpu_alone",
        "tests/interop/test_hf.py (the round trip in-process)",
    ),
    (
        "tests/data/test_prepare_safety.py::test_sigkill_mid_prepare_leaves_the_previous_pair_whole",
        "test_prepare_safety.py::test_an_out_it_did_not_write_is_replaced_only_with_overwrite",
    ),
    (
        "tests/comm/test_desync.py::test_missing_rank_is_named_algorithm_path",
        "test_desync.py::test_missing_rank_is_named_native_path",
    ),
    (
        "tests/train/test_expert_tp_trainer.py::test_checkpoint_at_ep2_tp2_resumes_in_one_process[etp1]",
        "tests/train/test_expert_trainer.py::test_checkpoints_reshard_across_ep[4-2]",
    ),
    (
        "tests/memory/test_chunked_loss.py::test_chunked_loss_vocab_parallel[3]",
        "test_chunked_loss_vocab_parallel[2]",
    ),
    (
        "tests/memory/test_fp32_reuse.py::test_bf16_training_is_bit_identical_with_shared_masters[dp2-tp2-zero1]",
        "[one-process] and [pp2-dp2-zero2] of the same test",
    ),
    (
        "tests/memory/test_swap.py::test_training_is_bit_identical_with_swapped_activations[dp2-tp2-sp]",
        "[one-process] and [pp2-dp2] of the same test",
    ),
    (
        "tests/memory/test_trainer_chunked_loss.py::test_chunked_loss_trains_like_the_full_logits[dp2-tp2]",
        "[dp2-tp2-sp] of the same test",
    ),
    (
        "tests/memory/test_trainer_chunked_loss.py::test_chunked_loss_trains_like_the_full_logits[dp2-cp2]",
        "tests/parallel/test_zero3.py::test_trainer_losses_equal_single_process[cp2]; [dp4-zero1] of the "
        "same test",
    ),
    (
        "tests/memory/test_trainer_chunked_loss.py::test_chunked_loss_trains_like_the_full_logits[pp2-tp2-sp]",
        "[pp2-dp2] and [dp2-tp2-sp] of the same test",
    ),
    (
        "tests/parallel/test_context.py::test_trainer_first_ten_losses_equal_single_process[cp2-tp2-sp-ulysses]",
        "[cp2-ulysses] and [cp4-hybrid] of the same test",
    ),
    (
        "tests/parallel/test_pipeline_runtime.py::test_every_schedule_matches_one_process[pp2-dp2]",
        "[pp2] and [pp4] of the same test",
    ),
    (
        "tests/parallel/test_zero3.py::test_trainer_losses_equal_single_process[dp2-tp2]",
        "[dp2], [cp2] and [moe-dp4-ep2] of the same test; "
        "tests/parallel/test_zero3.py::test_zero3_dp2_tp2_tied_embeddings_matches_one_process",
    ),
    (
        "tests/parallel/test_zero3.py::test_trainer_losses_equal_single_process[dp2-tp2-sp]",
        "test_zero3_dp2_tp2_tied_embeddings_matches_one_process",
    ),
    (
        "tests/parallel/test_zero3.py::test_trainer_losses_equal_single_process[moe-dp2]",
        "[moe-dp4-ep2] of the same test",
    ),
    (
        "tests/parallel/test_zero3.py::test_trainer_losses_equal_single_process[moe-ep2]",
        "[moe-dp4-ep2] of the same test",
    ),
    (
        "tests/parallel/test_zero3.py::test_trainer_losses_equal_single_process[dp2-recompute-chunked-loss]",
        "[dp2] of the same test; tests/memory/test_trainer_recompute.py",
    ),
    (
        "tests/parallel/test_zero_overlap.py::test_prefetched_gather_equals_blocking_gather[1-2]",
        "[2-2] of the same test",
    ),
    (
        "tests/parallel/test_zero_overlap.py::test_prefetched_gather_equals_blocking_gather[1-4]",
        "[2-4] of the same test",
    ),
    (
        "tests/parallel/test_zero_overlap.py::test_prefetched_gather_equals_blocking_gather[2-3]",
        "[1-3] of the same test",
    ),
    (
        "tests/pipeline/test_dualpipev_runtime.py::test_moe_overlap_is_exact_and_hands_over[pp2-ep2]",
        "[pp2-ep2-zero1] of the same test",
    ),
    (
        "tests/pipeline/test_dualpipev_runtime.py::test_moe_overlap_is_exact_and_hands_over[pp2-tp2]",
        "[pp2-ep2-zero1] of the same test",
    ),
    (
        "tests/test_benchmarks.py::test_dtensor_tp_peer_matches_one_device[tp]",
        "[tp-sp] of the same test",
    ),
    (
        "tests/train/test_expert_tp_trainer.py::test_ep2_tp2_losses_equal_one_process[etp2]",
        "[etp2-sp-allgather] of the same test",
    ),
    (
        "tests/train/test_expert_tp_trainer.py::test_ep2_tp2_losses_equal_one_process[pp2-tp2-etp1]",
        "[etp1] of the same test; tests/pipeline/test_dualpipev_runtime.py",
    ),
    (
        "tests/train/test_expert_trainer.py::test_expert_parallel_losses_equal_one_process[dp4-ep2-zero2]",
        "[ep4-zero1] of the same test",
    ),
    (
        "tests/train/test_sparsity_comm.py::test_trainer_losses_equal_dense_communication_and_bytes_are_n_over_m[dp2]",
        "[dp2-zero2] of the same test",
    ),
    (
        "tests/train/test_sparsity_comm.py::test_trainer_losses_equal_dense_communication_and_bytes_are_n_over_m[moe-dp2-zero1]",
        "[dp2-zero2] of the same test; tests/train/test_sparsity.py's moe cases",
    ),
    (
        "tests/faults/test_run_command.py::test_failed_rank_is_named_and_no_worker_is_left[kill]",
        "tests/faults/test_signals.py::test_killed_worker_is_named_with_its_signal (the same launcher)",
    ),
    (
        "tests/train/test_sparsity_elastic.py::test_resume_across_a_pattern_change_equals_the_straight_run",
        "tests/train/test_sparsity_comm.py::test_resume_keeps_the_packing_decision_and_an_async_update "
        "(a sparse run resumed bit for bit) and test_pattern_change_moves_sparsity_under_tp_and_zero",
    ),
    # --- a third cut for the 15-minute bound (session 6, measured: 945.9 s before it)
    (
        "tests/checkpoint/test_checkpoint.py::test_reshard_dp2_tp2_zero_to_tp4_and_dp4",
        "test_checkpoint.py::test_reshard_tp2_to_tp1_and_zero_dp2_to_tp2 (resharding across tp and "
        "ZeRO layouts); tests/train/test_expert_trainer.py::test_checkpoints_reshard_across_ep[4-2]",
    ),
    (
        "tests/train/test_trainer.py::test_tp2_checkpoint_resumes_under_tp1",
        "tests/checkpoint/test_checkpoint.py::test_reshard_tp2_to_tp1_and_zero_dp2_to_tp2 (the same "
        "tp 2 -> tp 1 resharding); tests/parallel/test_context.py::test_cp_checkpoint_resumes_without_cp",
    ),
    (
        "tests/train/test_sparsity_comm.py::test_trainer_losses_equal_dense_communication_and_bytes_are_n_over_m[dp2xtp2]",
        "[dp2-zero2] of the same test (the packed reduction); tests/train/test_sparsity.py::"
        "test_tp2_sparse_run_matches_single_process_and_masks_agree[tiny-2:4] (sparsity under tp)",
    ),
    (
        "tests/infer/test_parallel_generate.py::test_layouts_equal_single_process[tp2xpp2]",
        "test_layouts_equal_single_process[tp2], [pp2] and [dp2xpp2] (world 4) of the same test",
    ),
    # --- meshspeed.parallelize (issue 29): every worker that builds a transformers model imports
    # it (seconds per process on 2 cores); CI keeps one such pool (world 2) and the ws 3/4 layouts
    # on a custom module
    (
        "tests/interop/test_parallelize.py::test_hf_llama_loop_equals_one_process",
        "test_qwen2_tied_tp2_sp_with_biases_equals_one_process (the same inferred plan, with SP) and "
        "test_custom_module_loop_equals_one_process[dp2-tp2-plan] / [dp3-zero3] (dp × tp, ZeRO-3)",
    ),
    (
        "tests/interop/test_parallelize_experts.py::test_mixtral_expert_parallel_loop_equals_one_process[dp4-ep2-zero2]",
        "[ep2] and [ep3-zero3-mem] of the same test (world 2 and 3), and "
        "tests/train/test_expert_trainer.py::test_expert_parallel_losses_equal_one_process[ep4-zero1] "
        "(world 4)",
    ),
    (
        "tests/interop/test_parallelize_families.py::test_mistral_and_qwen2_loops_equal_one_process[dp2-tp2-sp]",
        "[tp2] of the same test (the same families in the world-2 pool) and "
        "test_parallelize.py::test_qwen2_tied_tp2_sp_with_biases_equals_one_process (the plan with SP)",
    ),
    # --- issue 44: every accepted setting value through two real steps, and the CLI run
    (
        "tests/train/test_settings_walk.py::test_every_setting_value_runs_two_steps",
        "test_settings_walk.py::test_one_value_per_section_runs_two_steps (one value per section)",
    ),
    (
        "tests/pipeline/test_trainer_schedules.py::test_cli_dualpipev_command_from_issue_44_trains",
        "test_trainer_schedules.py::test_dualpipev_trains_like_one_process[pp2-ep2] (the same layout "
        "in-process)",
    ),
    # --- issue 42: the Trainer against TRL over 20 steps (TRL's trainers ~20 s each on 2 cores)
    (
        "tests/post/test_trainer_vs_trl.py::test_dpo_trainer_equals_trl_20_steps",
        "test_trainer_vs_trl.py::test_dpo_trainer_equals_trl_3_steps (the same comparison, 3 steps)",
    ),
    (
        "tests/post/test_trainer_vs_trl.py::test_sft_trainer_equals_trl_20_steps",
        "test_trainer_vs_trl.py::test_sft_trainer_equals_trl_3_steps (the same comparison, 3 steps)",
    ),
    (
        "tests/infer/test_cli_generate.py::test_chat_layouts_equal_one_process",
        "test_cli_generate.py::test_chat_prompts_are_the_template (the chat prompt ids) and "
        "tests/infer/test_parallel_generate.py::test_layouts_equal_single_process (any ids, tp/dp/pp)",
    ),
    # --- issue 41: dit through the Trainer; the same claims at a cheaper layout stay in CI
    (
        "tests/train/test_dit_trainer.py::test_layout_equals_one_process[dp2-zero1]",
        "test_dit_trainer.py::test_layout_equals_one_process[dp2-tp2-sp-zero1] (ZeRO-1 at world 4), "
        "[dp2-zero2] and [dp2-zero3]",
    ),
    (
        "tests/train/test_dit_trainer.py::test_layout_equals_one_process[tp2-recompute-selective]",
        "test_dit_trainer.py::test_layout_equals_one_process[dp2-recompute-full] and "
        "tests/models/test_dit.py (full and selective recompute give the same gradients)",
    ),
    (
        "tests/train/test_dit_trainer.py::test_resume_in_another_layout_keeps_the_ema",
        "test_dit_trainer.py::test_resume_with_ema_equals_uninterrupted (the EMA's round trip) and "
        "test_layout_equals_one_process[dp2-zero3] (the EMA gathered from ZeRO-3 shards)",
    ),
    (
        "tests/train/test_dit_cli.py::test_train_config_then_sample",
        "test_dit_cli.py::test_sample_loads_the_ema (the EMA into the sampler, in-process); "
        "docs/diffusion.md's commands in the docs test (slow) run configs/dit-tiny.toml too",
    ),
    # --- issue 41: `meshspeed sample --nproc 2/3` launches workers that import torch (10-16 s)
    (
        "tests/infer/test_cli_sample.py::test_nproc_writes_the_same_pngs",
        "tests/infer/test_diffusion.py::test_dp_gives_byte_identical_pngs (the same sampling at dp 2 "
        "and 3 in the pool) and test_cli_sample.py::test_run_dir_samples (the run directory's loading)",
    ),
    # --- issue 41: dit training through the Trainer under cp / pp (a single-process reference
    # run plus the layout's, 15-20 s); the same layouts stay in CI at the model level
    (
        "tests/parallel/test_context_full.py::test_flow_training_under_cp_equals_single_process",
        "tests/parallel/test_context_full.py::test_dit_context_parallel_matches_single_device "
        "(cp 2/3/4: ring, Ulysses, hybrid, × dp, × tp + SP)",
    ),
    (
        "tests/parallel/test_dit_pipeline.py::test_flow_training_under_pp_equals_single_process",
        "tests/parallel/test_dit_pipeline.py::test_dit_pipeline_matches_single_device "
        "(every schedule at pp 2, × tp + SP, × cp, with evaluation)",
    ),
]
SLOW: dict[str, str] = dict(_ENTRIES)
