"""The device scan's allow-lists (tests/device_scan.py; the rules: the docstring of
tests/test_device_discipline.py). Host syncs have their own list, with the docs' table:
shardtrain/train/syncs.py STEP_SYNCS. Every entry must match something the scan flags."""

from __future__ import annotations

# (file under shardtrain/, function; "*": the whole file) -> why it runs outside the step.
OFF_STEP = {
    ("comm/dispatch.py", "agreed_link"): "a communicator's construction (the link it prices)",
    ("ckpt/files.py", "*"): "checkpoint reads",
    ("ckpt/frames.py", "*"): "checkpoint saves: each chunk's raw bytes framed on the host",
    ("ckpt/stream.py", "*"): "checkpoint saves: chunks staged into the host pool and written "
                             "(an async save's staging waits only for its own copies)",
    ("model/generate.py", "*"): "text generation after training (train/finetune/sample.py)",
    ("model/hf.py", "*"): "Hugging Face weights in and out, at start and end",
    ("model/hf_names.py", "_expert_maps"): "the zeros DeepSeek-V3's router bias is exported "
                                           "as without an expert bias: export, on the host",
    ("model/experts.py", "__init__"): "parameters built on the meta device, materialised by "
                                      "parallel/build.py on the rank's device",
    ("model/moe.py", "__init__"): "the expert bias buffer built on the meta device, "
                                  "materialised by parallel/build.py on the rank's device",
    ("model/positions.py", "rope_tables"): "rotary tables built once, moved with the module",
    ("model/positions.py", "yarn_frequencies"): "rotary tables built once (rope_tables)",
    ("model/transformer.py", "init_state_buffers"): "rotary tables built with the model, moved with it",
    ("model/transformer.py", "init_tensor"): "start values drawn on the host from (seed, "
                                             "name) alone, copied into the built shards",
    ("model/transformer.py", "init_expert"): "as init_tensor, per expert",
    ("parallel/data/topk.py", "load_optimizer_files"): "checkpoint load",
    ("parallel/pieces.py", "*"): "checkpoint pieces (save and load)",
    ("parallel/ps/worker.py", "send_weights"): "worker 0 gives the servers their starting "
                                               "weights, once before step 1",
    ("parallel/pipeline/state.py", "all_gather_objects"): "full state dicts and checkpoint "
                                                          "metadata: host bytes by nature",
    ("parallel/pipeline/stage.py", "__init__"): "placeholder rotary buffers, moved with the "
                                                "module (.to(device)) and filled by "
                                                "init_weights",
    ("parallel/zero/model.py", "local_state_dict"): "full state dicts (sample, export, tests)",
    ("parallel/zero/optim8bit.py", "load_shard_state"): "checkpoint load",
    ("train/optim.py", "load_state_dict"): "checkpoint load (Optimizer16's fp32 moments)",
    ("parallel/zero/offload.py", "__init__"): "ZeRO-Offload's host copies of the master, "
                                              "made once at build",
    ("parallel/zero/offload.py", "load_shard_state"): "checkpoint load",
    ("parallel/zero/offload.py", "_map"): "the NVMe file mapped once (host memory by nature)",
    ("parallel/zero/offload.py", "_write_file"): "the NVMe file written once at build",
    ("parallel/pipeline/runtime.py", "evaluate"): "evaluation (forward only), after the "
                                                  "logged step's flush",
    ("parallel/ps/server.py", "*"): "the parameter server: a host process by design "
                                    "(parallel/ps/groups.py)",
    ("quant/blockwise.py", "dynamic_map"): "a code table built once (functools.cache)",
    ("quant/blockwise.py", "_zero_code"): "a code table index, built once (functools.cache)",
    ("quant/blockwise.py", "_boundaries"): "bucket bounds built once (functools.cache)",
    ("quant/blockwise.py", "_table"): "a code table copied to a device once (functools.cache)",
    ("quant/nf4.py", "nf4_levels"): "NF4's 16 levels, built once",
    ("quant/nf4.py", "_levels_on"): "NF4's levels copied to a device once (functools.cache)",
    ("quant/nf4.py", "quantize_"): "QLoRA's frozen base weights, quantized at build and load",
    ("train/adam8bit.py", "load_canonical"): "checkpoint load",
    ("train/start/calibrate.py", "*"): "`shardtrain calibrate`: a measurement, no training step",
    ("train/finetune/export.py", "*"): "export after training",
    ("train/observe/metrics.py", "measure_matmul_flops"): "the CPU's peak, measured once per process",
    ("train/observe/metrics.py", "clock"): "a wall clock for the benchmarks, not called in the step",
    ("train/finetune/peft_format.py", "*"): "adapter files written after training",
    ("train/finetune/sample.py", "*"): "the sample generated after training",
    ("train/ps_server.py", "*"): "the parameter server's loop: a host process by design",
    ("train/trainer.py", "evaluate"): "periodic evaluation: a logged step, after the flush",
}
# (file, function, factory) -> why this factory in step code names no device.
FACTORIES_ALLOWED = {
    ("train/adam8bit.py", "step", "zeros"):
        "the step count is a host scalar on purpose, as torch.optim.AdamW's "
        "(non-capturable) one: read every step with no device sync",
}
# (file, function, call) -> why this device copy in step code blocks nothing, or must.
COPIES_ALLOWED = {
    ("comm/algorithms/alltoall.py", "bruck", "tensor"):
        "shardtrain's own algorithms run on CPU tensors only (a CUDA communicator refuses "
        "them: comm/communicator.py): index lists, no device",
    ("parallel/precision.py", "read_flags", "to"):
        "the step's decision: a parameter server's gradient norm is a host tensor, the loss's "
        "flag joins it just before the listed tolist reads both (elsewhere: one device)",
    ("train/pace.py", "gather", "tensor"):
        "logged steps: this rank's three host figures, gathered after the flush",
    ("parallel/zero/model.py", "clip_grad_norm", "to"):
        "gradient offload only (elsewhere a no-op: one device): a host gradient shard's "
        "squared norm joins the device total, and the clip scale reaches the host shard",
    ("parallel/zero/reducer.py", "_complete", "to"):
        "gradient offload only (elsewhere a no-op): the reduced shard leaves the device into "
        "the host optimizer's buffer, once per micro-batch, as ZeRO-Offload moves it",
    ("train/pending.py", "add", "to"):
        "a cast on the step's device; only a parameter server's gradient norm (a host "
        "scalar: that layout's host work, by design) is copied to the loss's device",
}
# (file, function) -> why step code names the CPU literally.
CPU_ALLOWED = {
    ("parallel/offload_activations.py", "_pack"): "activation offload (train.activation_offload"
                                                  "=cpu): saved tensors go to host memory",
    ("parallel/zero/offload.py", "fetch"): "ZeRO-Offload's pinned host side of an NVMe read",
}
