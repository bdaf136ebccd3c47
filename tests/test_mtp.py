"""Multi-token prediction (model/mtp.py): the shifted targets (document boundaries, masked
targets), the modules' wiring against a by-hand forward, the objective, eval and sampling
on the main model alone, the metrics, and the layouts refused before any work."""

from __future__ import annotations

import itertools
import json

import pytest
import torch
import torch.nn.functional as F

from shardtrain import config
from shardtrain.config import ConfigError
from shardtrain.config.data import IGNORE
from shardtrain.model.mtp import MTPLoss, MTPOutput, depth_batch, depth_targets, same_document
from shardtrain.model.transformer import build_model
from shardtrain.parallel.tensor.vocab import cross_entropy
from shardtrain.train.trainer import Trainer

from chat_data import llama_dir, write_chat
from parity import make_mesh, tiny

MTP = ("--model.mtp_depth", "2")


def _reference_targets(targets: list[int], positions: list[int] | None, k: int) -> list[int]:
    """Depth k's targets by the definition: token i + k + 1 (the main target at i + k),
    kept only inside the row and, with documents, inside token i's document."""
    s = len(targets)
    doc = list(itertools.accumulate(int(p == 0) for p in positions)) if positions else None
    out = []
    for i in range(s):
        j = i + k  # the main target at j is token j + 1
        inside = j < s if doc is None else j + 1 < s and doc[j + 1] == doc[i]
        out.append(targets[j] if inside else IGNORE)
    return out


@pytest.mark.parametrize("k", [1, 2, 3])
def test_depth_targets_stay_in_the_row_the_document_and_the_mask(k):
    """Positions 0 1 2 3 | 0 1 | 0 1 2 3 (three packed documents), some targets masked as
    chat's prompts are: depth k keeps a target only where the main target at i + k counts
    and token i + k + 1 lies in token i's document."""
    positions = torch.tensor([[0, 1, 2, 3, 0, 1, 0, 1, 2, 3]])
    targets = torch.tensor([[11, 12, IGNORE, 14, 15, IGNORE, 17, 18, 19, 20]])
    got = depth_targets(targets, k, same_document(positions, k))
    want = _reference_targets(targets[0].tolist(), positions[0].tolist(), k)
    assert got[0].tolist() == want
    plain = depth_targets(targets, k, None)  # no documents: only the row's end and the mask
    assert plain[0].tolist() == _reference_targets(targets[0].tolist(), None, k)
    assert plain[0, -k:].eq(IGNORE).all()


def test_modules_compute_the_papers_equations(tmp_path):
    """Depth k at position i: Block_k(M_k [RMSNorm(h^{k-1}_i); RMSNorm(Emb(t_{i+k}))]) through
    the shared head, h^0 the last block's output before the final norm; the main logits
    are those of the same model without the modules (init is by name)."""
    cfg = tiny(tmp_path, "m", *MTP).model
    model = build_model(cfg).train()
    plain = build_model(tiny(tmp_path, "p").model)
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    out = model(tokens)
    assert isinstance(out, MTPOutput) and len(out.depths) == 2
    torch.testing.assert_close(out.logits, plain(tokens), rtol=0, atol=0)
    h = model.tok_emb(tokens)
    rope = (model.rope_cos[:16], model.rope_sin[:16])
    for layer in model.layers:
        h = layer(h, rope)
    for k, module in enumerate(model.mtp, start=1):
        n = 16 - k  # the paper's trimmed sequence
        e = module.e_norm(model.tok_emb(tokens[:, k:]))
        x = F.linear(torch.cat([module.h_norm(h[:, :n]), e], -1), module.proj.weight)
        h = module.block(x, (rope[0][:n], rope[1][:n]))
        torch.testing.assert_close(out.depths[k - 1][:, :n], model.head(module.out_norm(h)),
                                   rtol=1e-5, atol=1e-5)
    model.eval()  # inference, evaluation and sampling: the main model alone
    torch.testing.assert_close(model(tokens), out.logits, rtol=0, atol=0)


def test_packed_documents_predict_as_each_alone(tmp_path):
    """With packed documents every depth's counted predictions, and its summed loss, equal
    those of each document run alone: attention stays inside documents and no counted
    target crosses a boundary."""
    model = build_model(tiny(tmp_path, "m", "--model.mtp_depth", "3").model).train()
    gen = torch.Generator().manual_seed(1)
    lengths = [7, 5, 20]
    docs = [torch.randint(0, 256, (1, n + 1), generator=gen) for n in lengths]
    tokens = torch.cat([d[:, :-1] for d in docs], 1)  # [1, 32]
    targets = torch.cat([d[:, 1:] for d in docs], 1)
    positions = torch.cat([torch.arange(n) for n in lengths])[None]

    def depth_sums(tokens: torch.Tensor, targets: torch.Tensor, positions: torch.Tensor
                   ) -> torch.Tensor:
        inputs, stacked = depth_batch(tokens, targets, positions, 3)
        out = model(tokens, positions, mtp_tokens=inputs)
        return torch.stack([F.cross_entropy(logits.flatten(0, 1), stacked[..., k].flatten(),
                                            ignore_index=IGNORE, reduction="sum")
                            for k, logits in enumerate(out.depths, 1)])

    packed = depth_sums(tokens, targets, positions)
    # alone: one document in its row, whose depth-k targets past its end are not counted
    alone = sum(depth_sums(d[:, :-1], d[:, 1:], torch.arange(n)[None])
                for d, n in zip(docs, lengths))
    torch.testing.assert_close(packed, alone, rtol=1e-5, atol=1e-4)
    assert (packed > 0).all()


def test_objective_weighs_the_depths_by_coef_over_depth(tmp_path):
    cfg = tiny(tmp_path, "m", *MTP, "--model.mtp_loss_coef", "0.3").model
    gen = torch.Generator().manual_seed(2)
    out = MTPOutput(torch.randn(2, 8, 256, generator=gen),
                    [torch.randn(2, 8, 256, generator=gen) for _ in range(2)])
    targets = torch.randint(0, 256, (2, 8), generator=gen)
    targets[0, :3] = IGNORE  # masked targets count nowhere
    stacked = depth_batch(targets, targets, None, 2)[1]  # [2, 8, 3]
    objective, parts = MTPLoss(cross_entropy, cfg)(out, stacked)
    main = int(targets.ne(IGNORE).sum())  # eq. 24: each depth's token losses summed / T
    want = [cross_entropy(out.logits, targets)] + [F.cross_entropy(
        out.depths[k - 1].flatten(0, 1), depth_targets(targets, k, None).flatten(),
        ignore_index=IGNORE, reduction="sum") / main for k in (1, 2)]
    torch.testing.assert_close(parts, torch.stack(want))
    torch.testing.assert_close(objective, want[0] + 0.3 / 2 * (want[1] + want[2]))
    plain = torch.randn(2, 8, 256, generator=gen)  # eval logits: the plain loss
    torch.testing.assert_close(MTPLoss(cross_entropy, cfg)(plain, stacked),
                               cross_entropy(plain, targets))


def test_metrics_report_each_depth_and_resume(tmp_path):
    """metrics.jsonl: `loss` the main loss, `mtp_losses` one per depth; the modules are
    trained and checkpointed, a resumed run continues bitwise, sampling runs."""
    steps = ("--train.steps", "4", "--checkpoint.every", "2", "--train.sample_tokens", "4")
    cfg = tiny(tmp_path, "whole", *MTP, *steps)
    trainer = Trainer(cfg, make_mesh(cfg, 0, 1), torch.device("cpu"))
    whole = trainer.run()
    rows = [json.loads(line) for line in (tmp_path / "whole" / "metrics.jsonl").read_text()
            .splitlines()]
    assert [len(r["mtp_losses"]) for r in rows] == [2] * 4
    # about ln 256 x (S - k) / S (eq. 24: the depth's sum over the S main targets), trained
    assert all(4.0 < v < 6.0 for r in rows for v in r["mtp_losses"])
    assert [r["loss"] for r in rows] == whole.losses and whole.sample is not None
    first = build_model(cfg.model)
    trained = trainer.parallel.full_state_dict()
    assert not torch.equal(trained["mtp.1.proj.weight"], first.mtp[1].proj.weight)
    step2 = tmp_path / "whole" / "checkpoints" / "step_00000002"
    cfg = tiny(tmp_path, "resumed", *MTP, *steps, "--checkpoint.resume", str(step2))
    resumed = Trainer(cfg, make_mesh(cfg, 0, 1), torch.device("cpu"))
    assert resumed.run().losses == whole.losses[2:]
    for name, w in resumed.parallel.full_state_dict().items():
        assert torch.equal(w, trained[name]), name


def test_chat_sft_masks_and_documents_carry_to_every_depth(tmp_path):
    """Chat SFT rows packed as documents, from a Hugging Face Llama (model.init_from: the
    modules drawn, the family has none): step 1's logged depth losses are the sums over
    the targets the definition keeps (the assistant's tokens, inside each conversation),
    over the global batch's counted main targets (eq. 24's 1 / T)."""
    pytest.importorskip("transformers")
    llama = llama_dir(tmp_path / "llama")
    cfg = tiny(tmp_path, "sft", *MTP, "--model.init_from", str(llama), "--data.format", "chat",
               "--data.source", str(write_chat(tmp_path / "chat.jsonl", 100, turns=2)),
               "--data.document_mask", "true", "--train.steps", "1")
    trainer = Trainer(cfg, make_mesh(cfg, 0, 1), torch.device("cpu"))
    state = trainer.sampler.state_dict()
    batches = trainer.sampler.next_step()
    trainer.sampler.load_state_dict(state)
    counted = sum(int(b[1].ne(IGNORE).sum()) for b in batches)
    want, crossed = torch.zeros(2), 0
    with torch.no_grad():
        for inputs, targets, positions in batches:
            out = trainer.parallel.module(inputs, positions)
            for k in (1, 2):
                kept = torch.tensor([_reference_targets(t.tolist(), p.tolist(), k)
                                     for t, p in zip(targets, positions)])
                crossed += int((kept != depth_targets(targets, k, None)).sum())
                # eq. 24: the depth's token losses over the main targets' count
                want[k - 1] += F.cross_entropy(out.depths[k - 1].flatten(0, 1), kept.flatten(),
                                               ignore_index=IGNORE, reduction="sum") / counted
    assert crossed > 0 and 0 < counted < sum(b[1].numel() for b in batches)
    record = trainer.run().history[0]
    torch.testing.assert_close(torch.tensor(record["mtp_losses"]), want, rtol=1e-5, atol=0)


@pytest.mark.parametrize("overrides,field", [
    (("--model.mtp_depth", "-1"), "model.mtp_depth"),
    (("--model.mtp_loss_coef", "-0.1"), "model.mtp_loss_coef"),
    ((*MTP, "--model.dim", "42", "--model.n_heads", "8", "--model.n_kv_heads", "8",
      "--model.head_size", "8", "--model.ffn_dim", "64", "--parallel.tp", "8"), "mtp_depth=2 with parallel.tp=8"),
])
def test_refused_layouts_name_the_field(tmp_path, overrides, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        config.load("tiny", ["--train.run_dir", str(tmp_path), "--train.global_batch", "16",
                     *overrides]).validate(8)
