"""Every host sync left in the training step, with its reason: the one list
(tests/test_device_discipline.py scans the step's packages and allows these calls only;
docs/performance.md shows the same list to readers).

A host sync is a call that makes the host wait for the device (on a GPU, the launch queue
drains and the next kernels start late): `.item()`, `.tolist()`, `.cpu()`, `.numpy()`,
`bool`/`float`/`int` of a tensor, `synchronize()`. On CPU each is free; the rule is for
the GPU runs the CPU tests cannot time.

Keys: (file under shardtrain/, function, call); a key that matches no call is an error.
"""

from __future__ import annotations

STEP_SYNCS: dict[tuple[str, str, str], str] = {
    # -- every step, every layout: the one agreed decision
    ("parallel/precision.py", "read_flags", "tolist"):
        "the step's one agreed decision: whether its loss and gradient norm are finite (two "
        "flags, one transfer); the host must know whether the optimizer steps and where "
        "fp16's loss scale goes",
    ("parallel/pipeline/clock.py", "seconds", "synchronize"):
        "the timeline's last mark, read after the decision above has passed it: returns at "
        "once (it keeps a timeline read before the decision correct)",
    # -- logged steps only (train.log_every, the last, evals, bad steps, checkpoints)
    ("train/pending.py", "flush", "tolist"):
        "logged steps: every waiting step's loss, gradient norm and MoE totals, one transfer",
    ("train/pending.py", "wait", "synchronize"):
        "logged steps: the last waiting step's end mark, so the step times can be read",
    ("train/pace.py", "measure", "tolist"):
        "logged steps: every rank's compute and wait seconds, gathered after the flush",
    ("train/pace.py", "gather", "cpu"):
        "logged steps: the gathered [world, 3] figures, after the flush",
    # -- layouts that need host values by design
    ("parallel/ps/worker.py", "_pump", "synchronize"):
        "parameter server on a GPU: one partition's pinned copy, waited for just before the "
        "codec and Gloo read its bytes on the host (backward never waits for it)",
    ("parallel/ps/worker.py", "local_grad_norm", "float"):
        "parameter server: the push header carries this worker's gradient norm as host bytes",
    ("parallel/expert/layers.py", "exchange_counts", "tolist"):
        "expert parallelism: the all-to-all's split sizes are host integers (torch's "
        "all_to_all_single takes lists), one read of the exchanged counts per MoE layer",
    ("parallel/expert/grouped.py", "grouped_exchange", "tolist"):
        "expert parallelism, one row per kept group: the same one read of the exchanged "
        "counts per MoE layer (rows per group and slots), replacing exchange_counts'",
    ("model/experts.py", "_looped", "tolist"):
        "moe_impl=looped only (the grouped kernel's baseline): the per-expert loop needs "
        "its slice ends on the host",
    ("parallel/zero/offload.py", "step", "cpu"):
        "ZeRO-Offload (offload=cpu): the optimizer runs on the host; each gradient window "
        "comes to it",
    ("parallel/zero/offload.py", "_step_cpu", "synchronize"):
        "ZeRO-Offload: a shard's gradient copy (its own stream) is waited for before the "
        "host updates it",
    ("model/positions.py", "from_positions", "tolist"):
        "document masks only (data.document_mask): each row's document starts, one read per "
        "forward, as host integers for the per-document kernel calls (no [S, S] mask), and "
        "under cp one more per micro-batch, to slice it by the documents' balanced chunks",
    ("parallel/offload_activations.py", "_retire", "synchronize"):
        "activation offload on a GPU (train.activation_offload=cpu): the copies down of the "
        "block two back, so the allocator can reuse their memory and the window bounds it "
        "(waits only when the copies lag the compute)",
    ("parallel/context/timer.py", "seconds", "synchronize"):
        "context parallelism on a GPU: the attention timer's last event, read per step for "
        "the timeline's attention_s",
    ("parallel/pipeline/runtime.py", "_weights", "int"):
        "not a device read: each micro-batch's counted targets, from the sampler's host "
        "tensors (the executor moves them to the device)",
    ("comm/dispatch.py", "check_splits", "item"):
        "all_to_all size checks (the first call, or comm.check_sizes=all): CPU metadata on "
        "the Gloo side channel, no device involved",
    ("comm/dispatch.py", "check_splits", "tolist"):
        "as above: the splits compared across ranks are host metadata",
}
