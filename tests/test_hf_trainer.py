"""The HF ``Trainer(fp16=True)`` path the README describes: ``watch()`` from a ``TrainerCallback``,
and ``ampdoctor run`` on a Trainer script with no ampdoctor call (automatic watching). CUDA only
(the Trainer's fp16 needs a GPU); skipped where transformers or accelerate is missing."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import textwrap

import pytest
import torch

import ampdoctor
from ampdoctor.trace import TraceReader

pytestmark = pytest.mark.cuda
transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

STEPS = 6


def _trainer(out_dir, callbacks=()):
    from transformers import BertConfig, BertForSequenceClassification, Trainer, TrainingArguments

    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=100, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                     intermediate_size=128, max_position_embeddings=64, num_labels=2)
    model = BertForSequenceClassification(cfg)
    data = [{"input_ids": torch.randint(0, 100, (16,)), "labels": torch.tensor(i % 2)} for i in range(64)]
    args = TrainingArguments(output_dir=str(out_dir), max_steps=STEPS, per_device_train_batch_size=8,
                             fp16=True, report_to=[], save_strategy="no", logging_steps=1,
                             disable_tqdm=True, dataloader_num_workers=0)
    return model, Trainer(model=model, args=args, train_dataset=data, callbacks=list(callbacks))


def test_watch_from_a_trainer_callback(tmp_path):
    from transformers import TrainerCallback

    trace = tmp_path / "t.sqlite"
    held = {}

    class Watch(TrainerCallback):
        def on_train_begin(self, args, state, control, model=None, **kw):
            held["w"] = ampdoctor.watch(model, trace=str(trace))

        def on_train_end(self, args, state, control, **kw):
            held["w"].remove()

    logged = []

    class Losses(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "loss" in logs:
                logged.append(logs["loss"])

    model, trainer = _trainer(tmp_path / "hf", [Watch(), Losses()])
    trainer.train()
    r = TraceReader(trace)
    steps = r.steps()
    assert [s["step"] for s in steps] == list(range(STEPS))
    assert r.meta()["format"] == "fp16"
    losses = [s["loss"] for s in steps]
    assert all(math.isfinite(x) for x in losses)
    # the Trainer logs each step's loss (logging_steps=1), rounded: ours is the same loss
    assert len(logged) == STEPS and all(abs(a - b) < 1e-3 + 1e-3 * abs(b) for a, b in zip(losses, logged))
    names = {x["name"] for x in r.layers()}
    assert "bert.encoder.layer.0.attention.self.query" in names
    kinds = {x["kind"] for x in r.stats()}
    assert {"activation", "gradient", "weight", "weight_grad"} <= kinds
    for e in r.events("note"):
        assert e["layer"] != "" and not e["detail"].get("message", "").startswith(":"), e
    for m in model.modules():  # remove() in on_train_end: nothing of ours is left
        assert not m._forward_hooks and not m._forward_pre_hooks


def test_ampdoctor_run_on_a_trainer_script(tmp_path):
    script = tmp_path / "train_hf.py"
    script.write_text(textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(tmp_path)!r})
        from test_hf_trainer_copy import _trainer
        model, trainer = _trainer({str(tmp_path / 'hf')!r})
        trainer.train()
    """))
    (tmp_path / "test_hf_trainer_copy.py").write_text(open(__file__).read())
    out = tmp_path / "run"
    p = subprocess.run([sys.executable, "-m", "ampdoctor", "run", "--out", str(out), str(script)],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    rep = json.loads((out / "report.json").read_text())
    r = TraceReader(out / "trace.sqlite")
    assert [s["step"] for s in r.steps()] == list(range(STEPS))
    assert any(x["name"] == "bert.encoder.layer.1.output.dense" for x in r.layers())
    assert rep  # the report was written from that trace
