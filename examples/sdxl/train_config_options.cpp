#include "train_config_options.hpp"

namespace sdxl::detail {

std::vector<Option> options_of(TrainConfig& c) {
  return {
      {"model", "model_config", &c.model_config, "\"tiny\", \"sdxl-base\", or a diffusers config.json / UNet folder"},
      {"model", "model_weights", &c.model_weights, "weights to start from (safetensors file, diffusers folder, single file); empty: random init"},
      {"lora", "rank", &c.lora_rank, "LoRA rank: train adapters on the frozen UNet (0: train the UNet itself)",
       "lora_rank"},
      {"lora", "alpha", &c.lora_alpha, "LoRA alpha: the adapters are scaled by alpha / rank (0: alpha = rank)",
       "lora_alpha"},
      {"lora", "dropout", &c.lora_dropout, "dropout on the adapters' input while training", "lora_dropout"},
      {"lora", "init_from", &c.lora_init_from,
       "start the adapters from this LoRA file (diffusers/PEFT or kohya naming; same rank and layers)",
       "lora_init_from"},
      {"data", "dataset", &c.dataset, "cached dataset folder (see docs/dataset.md)"},
      {"data", "synthetic", &c.synthetic, "train on generated samples with a learnable structure"},
      {"data", "synthetic_samples", &c.synthetic_samples, "number of synthetic samples"},
      {"data", "latent_size", &c.latent_size, "synthetic latent height and width (image size / 8)"},
      {"data", "text_length", &c.text_length, "synthetic text-embedding length in tokens"},
      {"data", "caption_dropout", &c.caption_dropout,
       "probability that a sample trains on the dataset's empty-prompt conditioning (0: off)"},
      {"train", "steps", &c.steps,
       "optimizer steps to train for; 0 with epochs (given epochs alone, steps is 0)"},
      {"train", "epochs", &c.epochs,
       "train for this many passes over the dataset instead of steps (one pass: the sampler's global batches of "
       "batch_size x ranks, leftovers of a bucket dropped; accumulation of them per step); 0: steps"},
      {"train", "batch_size", &c.batch_size, "samples per rank and micro-step"},
      {"train", "accumulation", &c.accumulation, "micro-steps per optimizer step"},
      {"train", "precision", &c.precision, "fp32, bf16, or fp16 (dynamic loss scaling)"},
      {"train", "prediction", &c.prediction, "epsilon or v_prediction"},
      {"train", "min_snr_gamma", &c.min_snr_gamma, "min-SNR loss weighting gamma (0: off)"},
      {"train", "noise_offset", &c.noise_offset, "noise offset (0: off)"},
      {"train", "activation_checkpointing", &c.activation_checkpointing, "recompute each UNet block in backward"},
      {"train", "checkpoint_units", &c.checkpoint_units,
       "with activation_checkpointing, the units recomputed: all; a count k: the k that free the most activation "
       "memory per recompute FLOP (partial checkpointing); fit: the fewest of those whose predicted peak fits this "
       "GPU (max_gpu_memory, else its memory; none when everything fits; on the CPU: all)",
       nullptr, true},
      {"train", "seed", &c.seed, "seed of data order, noise and timesteps"},
      {"optimizer", "optimizer", &c.optimizer, "adamw, lion or sgd"},
      {"optimizer", "lr", &c.lr, "peak learning rate"},
      {"optimizer", "lr_schedule", &c.lr_schedule, "constant, linear or cosine (after warm-up)"},
      {"optimizer", "warmup_steps", &c.warmup_steps, "linear warm-up steps"},
      {"optimizer", "scale_lr", &c.scale_lr, "multiply lr by world size x batch size x accumulation"},
      {"optimizer", "beta1", &c.beta1, "AdamW/Lion beta1"},
      {"optimizer", "beta2", &c.beta2, "AdamW/Lion beta2"},
      {"optimizer", "eps", &c.eps, "AdamW epsilon"},
      {"optimizer", "weight_decay", &c.weight_decay, "weight decay"},
      {"optimizer", "momentum", &c.momentum, "SGD momentum"},
      {"optimizer", "state_dtype", &c.state_dtype,
       "how the optimizer state (AdamW's m and v, the momentum) is stored: fp32, or bf16 rounded stochastically "
       "after each update (half the state's memory, and AdamW's update moves 20 bytes a parameter instead of 28; "
       "the math stays fp32; on the GPU and with offload_optimizer alike)"},
      {"optimizer", "max_grad_norm", &c.max_grad_norm, "global gradient-norm clipping (0: off)"},
      {"optimizer", "max_nonfinite_steps", &c.max_nonfinite_steps,
       "stop after this many steps in a row with non-finite gradients, each skipped (0: never stop)"},
      {"optimizer", "ema_decay", &c.ema_decay, "EMA of the weights, sharded like the optimizer (0: off)"},
      {"optimizer", "ema_every", &c.ema_every,
       "update the EMA every k optimizer steps only, with the decay of k steps (the same horizon; less host "
       "memory traffic with offload_optimizer); 1: every step"},
      {"zero", "stage", &c.stage, "ZeRO stage 0, 1, 2 or 3"},
      {"zero", "bucket_mib", &c.bucket_mib, "reduce-scatter bucket size in MiB"},
      {"zero", "reductions_in_flight", &c.reductions_in_flight,
       "gradient reductions (collectives over several ranks) in flight before backward waits for the oldest; "
       "each holds its bucket's buffers (the planner counts them)"},
      {"zero", "prefetch_units", &c.prefetch_units,
       "stage 3: units gathered ahead of the one in use (with offload_params: uploads overlapping compute); each "
       "holds a unit's parameters (the planner counts them; --fit picks the deepest that fits, up to 4); 0: gather "
       "each unit when it is entered"},
      {"zero", "shard_group_size", &c.shard_group_size,
       "hybrid sharding (HSDP): shard over groups of this many consecutive ranks (one node), replicate across the "
       "groups; must divide the number of ranks (0: shard over all ranks)"},
      {"zero", "accumulation_mode", &c.accumulation_mode, "each (reduce every micro-step) or boundary"},
      {"zero", "units", &c.units,
       "the UNet's ZeRO units, also its buckets and what checkpointing recomputes at once: layers (one per ResNet "
       "block, transformer layer and resampler; 93 for SDXL, at most 49 M parameters) or blocks (one per down, mid "
       "and up block; 9, up to 1.2 B)"},
      {"zero", "offload_optimizer", &c.offload_optimizer,
       "keep master weights, optimizer state and EMA in pinned host memory, updated by the CPU (stages 1-3)"},
      {"zero", "offload_params", &c.offload_params,
       "stage 3 with offload_optimizer: keep the parameter shards in pinned host memory as well (only gathered units on the GPU)"},
      {"zero", "offload_delayed_update", &c.offload_delayed_update,
       "with offload_optimizer: run the CPU update while the next step computes (ZeRO-Offload's delayed parameter "
       "update: each forward sees the parameters one update old; any accumulation, with or without offload_params)"},
      {"zero", "offload_accumulate_on_host", &c.offload_accumulate_on_host,
       "with offload_optimizer and accumulation: every micro-step's gradients stream to host memory and the CPU "
       "adds them (the same bits), so no gradient shard stays on the GPU (its whole size on one GPU); costs a "
       "pinned gradient shard on the host and a CPU pass per micro-step"},
      {"zero", "offload_ema_on_device", &c.offload_ema_on_device,
       "with offload_optimizer and an EMA, without offload_params: keep the EMA in GPU memory (4 bytes a "
       "parameter of the rank's shard); the CPU update sends its fp32 master up and the GPU updates the EMA and "
       "rounds the parameters, so the CPU moves 26 instead of 36 bytes a parameter (AdamW), the same bits"},
      {"zero", "offload_upload_during_backward", &c.offload_upload_during_backward,
       "with offload_delayed_update at stages 1-2: each bucket's updated parameters go up during the next "
       "backward, once backward is done with them and the CPU with the bucket, instead of all at the step (the "
       "same values; the next forward no longer waits behind the uploads)"},
      {"zero", "offload_gradient_stats_on_device", &c.offload_gradient_stats_on_device,
       "default true; with offload_optimizer: each bucket's gradient statistics are summed on the GPU as its "
       "gradients go down, instead of by the host gradient worker after they land (2 bytes a parameter less host "
       "memory traffic beside the CPU update, +7-15% offloaded images/s measured; the norm may differ from the "
       "host's by a few 1e-8); the worker still sums what offload_accumulate_on_host adds over several "
       "micro-steps"},
      {"zero", "offload_update_threads", &c.offload_update_threads,
       "with offload_optimizer: OpenMP threads of the CPU update that runs beside the GPU (the delayed update, the "
       "EMA); 0: OpenMP's default (OMP_NUM_THREADS, else the cores) less one, left to the thread that launches the "
       "kernels"},
      {"zero", "offload_gradient_threads", &c.offload_gradient_threads,
       "with offload_optimizer: OpenMP threads of the host gradient worker (statistics of the downloaded "
       "gradients, host accumulation), which runs during backward beside the delayed update; 0: as "
       "offload_update_threads"},
      {"zero", "delayed_update_warmup", &c.delayed_update_warmup,
       "with offload_delayed_update: this many first steps update synchronously"},
      {"output", "output_dir", &c.output_dir, "where metrics, checkpoints and exports go"},
      {"output", "log_every", &c.log_every, "steps between log lines"},
      {"output", "checkpoint_every", &c.checkpoint_every, "steps between checkpoints (0: at the end only)"},
      {"output", "checkpoint_every_epochs", &c.checkpoint_every_epochs,
       "checkpoint at the step that completes every this many epochs (0: off; with checkpoint_every, both)"},
      {"output", "export_every_epochs", &c.export_every_epochs,
       "export the UNet (as at the end) to output_dir/exports/epoch-NNNNNN at the step that completes every this many "
       "epochs (0: off)"},
      {"output", "keep_checkpoints", &c.keep_checkpoints, "checkpoints kept (older ones are deleted)"},
      {"output", "resume", &c.resume, "\"latest\" or a checkpoint folder to resume from"},
      {"output", "overwrite", &c.overwrite,
       "start afresh in an output_dir that holds another run: its checkpoints, metrics.jsonl and TensorBoard events "
       "are removed first (without it, such a folder is refused unless resuming); with --resume latest: start afresh "
       "when only incomplete checkpoints are there"},
      {"output", "accept_unchecksummed_checkpoint", &c.accept_unchecksummed_checkpoint,
       "resume from a checkpoint whose manifest lists no CRC32C (version 1), where a damaged shard would load "
       "unnoticed"},
      {"output", "stop_after", &c.stop_after, "save a checkpoint and stop after this step, to resume later (0: off)"},
      {"output", "export_single_file", &c.export_single_file, "also export the original single-file layout"},
      {"output", "export_dtype", &c.export_dtype,
       "fp32, bf16 or fp16: dtype of every exported UNet (folders, single files, full checkpoint); fp16 refuses "
       "values beyond its range"},
      {"output", "export_full_checkpoint", &c.export_full_checkpoint,
       "a base single-file SDXL checkpoint (original layout, e.g. sd_xl_base_1.0.safetensors): write "
       "output_dir/full_checkpoint.safetensors, the base with its UNet replaced by the trained one (checked before "
       "training); empty: off"},
      {"output", "export_full_checkpoint_unet", &c.export_full_checkpoint_unet,
       "the UNet the full checkpoint holds: auto (the EMA UNet when ema_decay > 0, else the trained one), ema or "
       "trained"},
      {"output", "save_final", &c.save_final, "save a checkpoint after the last step"},
      {"output", "export_unet", &c.export_unet, "export the UNet (and EMA UNet) in diffusers format at the end"},
      {"output", "merge_lora", &c.merge_lora,
       "with LoRA: also export the UNet with the adapters merged into its weights (output_dir/unet)"},
      {"validation", "every", &c.validation_every,
       "write validation images every this many steps and after the last one (output_dir/samples/step-N, "
       "TensorBoard), with the EMA weights when ema_decay > 0; 0: off", "validation_every"},
      {"validation", "negative_prompt", &c.validation_negative_prompt,
       "negative prompt of every validation image (empty: zeros, as SDXL does)", "validation_negative_prompt"},
      {"validation", "pipeline", &c.validation_pipeline,
       "diffusers SDXL pipeline folder: its VAE decodes the images, its text encoders encode prompts the dataset has "
       "not cached, its scheduler config gives the noise schedule", "validation_pipeline"},
      {"validation", "single_file", &c.validation_single_file,
       "instead of pipeline: an original single-file SDXL checkpoint (A1111/ComfyUI) whose VAE and text encoders "
       "serve the same way", "validation_single_file"},
      {"validation", "single_file_config", &c.validation_single_file_config,
       "with single_file: a diffusers pipeline folder whose configs describe its models (default: SDXL 1.0's); its "
       "tokenizers and scheduler serve as defaults", "validation_single_file_config"},
      {"validation", "tokenizer", &c.validation_tokenizer,
       "tokenizer folder (default: the pipeline's or single_file_config's tokenizer/)", "validation_tokenizer"},
      {"validation", "tokenizer_2", &c.validation_tokenizer_2,
       "second tokenizer folder (default: the pipeline's or single_file_config's tokenizer_2/)",
       "validation_tokenizer_2"},
      {"validation", "steps", &c.validation_steps, "denoising steps per validation image", "validation_steps"},
      {"validation", "guidance", &c.validation_guidance, "classifier-free guidance scale (> 1 enables it)",
       "validation_guidance"},
      {"validation", "seed", &c.validation_seed, "seed of image 0's initial noise (image i: seed + i; the same at "
       "every validation)", "validation_seed"},
      {"validation", "sampler", &c.validation_sampler, "euler, dpmpp_2m or dpmpp_2m_karras", "validation_sampler"},
      {"validation", "height", &c.validation_height, "validation image height, pixels (a multiple of 8)",
       "validation_height"},
      {"validation", "width", &c.validation_width, "validation image width, pixels (a multiple of 8)",
       "validation_width"},
      {"device", "device", &c.device, "cpu or cuda"},
      {"device", "cudnn_benchmark", &c.cudnn_benchmark,
       "time cuDNN's convolution algorithms on the first step of each shape and keep the fastest"},
      {"device", "tf32", &c.tf32,
       "let fp32 matmuls (cuBLAS) and convolutions (cuDNN) use TF32 tensor cores on CUDA (10-bit mantissa "
       "products); false: strict fp32. Only fp32 computation is affected"},
      {"device", "host_threads", &c.host_threads,
       "LibTorch's intra-op threads on each rank's host (its CPU tensor operations: on a GPU, the micro-step's "
       "inputs and exports; with device = cpu, the whole model); 0: the host's cores / ranks on it. The "
       "engine's own CPU teams are offload_update_threads and offload_gradient_threads"},
      {"device", "max_gpu_memory", &c.max_gpu_memory,
       "cap GPU memory per rank, e.g. 24GiB (allocator limit + the engine's accounting); empty: no cap"},
      {"device", "fit", &c.fit,
       "choose batch_size and accumulation (same global batch), stage, offload_optimizer, offload_params, "
       "offload_delayed_update and activation_checkpointing for the most predicted images/s within this GPU memory "
       "per rank, e.g. 12GiB (zero-plan --fit), then cap the run at it as max_gpu_memory; options given on the "
       "command line are kept; a resumed run keeps the checkpoint's; empty: off"},
      {"device", "attention", &c.attention,
       "attention kernel on the GPU: default (LibTorch's choice), flash, efficient, cudnn or math"},
      {"device", "channels_last", &c.channels_last,
       "run the UNet's convolutions, GroupNorms and SiLUs in channels-last (NHWC) memory order: no NCHW<->NHWC "
       "transposes in cuDNN, fused NHWC GroupNorm+SiLU on CUDA"},
      {"device", "cuda_graph", &c.cuda_graph,
       "capture the micro-step in a CUDA graph after the first step and replay it (no launch overhead): forward and "
       "backward at stages 0-1, the reductions and stage-3 gathers too at stages 2-3, and with activation "
       "checkpointing the recompute; needs accumulation 1, no offload, bf16 or fp32"},
      {"device", "deterministic", &c.deterministic,
       "deterministic kernels only, for runs that repeat bit for bit (and cuda_graph runs equal to eager ones): "
       "cuDNN's deterministic algorithms with its autotuner off, cuBLAS with a fixed workspace "
       "(CUBLAS_WORKSPACE_CONFIG=:4096:8 unless set), attention's deterministic backward; an operation without a "
       "deterministic kernel stops the run with its name. Slower"},
      {"device", "profile_step", &c.profile_step,
       "write a Kineto trace of this step (rank 0, CUDA) to output_dir/profile-step-N.json (0: off)"},
  };
}

}  // namespace sdxl::detail
