"""An exported converted model loads and runs in a fresh process that has only imported
paddle_unpad: with ``paddle.jit.load`` and with a ``paddle.inference`` predictor.

The export happens here (the test process); loading happens in a new interpreter that
calls no paddle_unpad function, so nothing but ``import paddle_unpad`` can have
registered the custom operators the program contains. The reference is the unconverted
PaddleNLP model with the same weights.
"""

import json
import os
import subprocess
import sys

import numpy as np
import paddle
import pytest

import paddle_unpad as pu
from export_util import to_static_packed, to_static_padded
from model_util import small_config

pytestmark = [pytest.mark.usefixtures("native_ops"), pytest.mark.paddle_gpu_stage]

T = pytest.importorskip("paddlenlp.transformers")

LENGTHS = [5, 1, 9, 3]

LOADER = r"""
import json, sys
import numpy as np
import paddle
import paddle_unpad  # the only paddle_unpad line: importing must be enough

prefix, inputs_file, out_file = sys.argv[1:4]
arrays = dict(np.load(inputs_file))
order = json.loads(arrays.pop("__order__").tobytes().decode())
feeds = [arrays[name] for name in order]
out = {}
loaded = paddle.jit.load(prefix)
res = loaded(*[paddle.to_tensor(a) for a in feeds])
out["jit_load"] = (res[0] if isinstance(res, (list, tuple)) else res).numpy()

from paddle import inference
import os
model_file = next(prefix + ext for ext in (".json", ".pdmodel") if os.path.exists(prefix + ext))  # 3.x PIR / 2.6
config = inference.Config(model_file, prefix + ".pdiparams")
config.disable_gpu()
if paddle.__version__.startswith("2.6"):  # its seqpool_cvm_concat_fuse_pass crashes on custom ops
    config.delete_pass("seqpool_cvm_concat_fuse_pass")
predictor = inference.create_predictor(config)
names = predictor.get_input_names()
assert sorted(names) == sorted(order), (names, order)
for name in names:
    predictor.get_input_handle(name).copy_from_cpu(arrays[name])
predictor.run()
out["predictor"] = predictor.get_output_handle(predictor.get_output_names()[0]).copy_to_cpu()
np.savez(out_file, **out)
print("loaded-ok")
"""


def _pair():
    no_dropout = dict(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)

    def config():
        return small_config(T.BertConfig, 97, 64, 2, 4, max_position_embeddings=40, num_labels=3, **no_dropout)

    paddle.seed(0)
    ref = T.BertForSequenceClassification(config())
    model = T.BertForSequenceClassification(config())
    model.set_state_dict(ref.state_dict())
    ref.eval(), model.eval()
    pu.convert(model)
    return ref, model


def _batch(seed=1):
    rng = np.random.default_rng(seed)
    S = max(LENGTHS)
    ids = np.zeros((len(LENGTHS), S), np.int64)
    mask = np.zeros_like(ids)
    for b, n in enumerate(LENGTHS):
        ids[b, :n] = rng.integers(3, 97, n)
        mask[b, :n] = 1
    return ids, mask


def _load_in_fresh_process(tmp_path, prefix, feeds):
    inputs = tmp_path / "inputs.npz"
    order = np.frombuffer(json.dumps(list(feeds)).encode(), dtype=np.uint8)
    np.savez(inputs, __order__=order, **feeds)
    out = tmp_path / "out.npz"
    script = tmp_path / "load.py"
    script.write_text(LOADER)
    proc = subprocess.run(
        [sys.executable, str(script), prefix, str(inputs), str(out)],
        cwd=str(tmp_path),
        env=dict(os.environ, OMP_NUM_THREADS="1"),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0 and "loaded-ok" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-4000:]
    return dict(np.load(out))


def _rel(a, b):
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))


def test_packed_export_loads_in_fresh_process(tmp_path):
    ref, model = _pair()
    ids, mask = _batch()
    expected = ref(paddle.to_tensor(ids), attention_mask=paddle.to_tensor(mask)).numpy()
    static = to_static_packed(model)
    prefix = str(tmp_path / "packed")
    paddle.jit.save(static, prefix)
    cu = np.concatenate([[0], np.cumsum(LENGTHS)]).astype(np.int32)
    got = _load_in_fresh_process(tmp_path, prefix, {"input_ids": ids[mask.astype(bool)], "cu_seqlens": cu})
    for how in ("jit_load", "predictor"):
        assert got[how].shape == expected.shape, (how, got[how].shape)
        assert _rel(got[how], expected) < 1e-5, (how, _rel(got[how], expected))


def test_padded_export_loads_in_fresh_process(tmp_path):
    ref, model = _pair()
    ids, mask = _batch(seed=2)
    expected = ref(paddle.to_tensor(ids), attention_mask=paddle.to_tensor(mask)).numpy()
    static = to_static_padded(model)
    prefix = str(tmp_path / "padded")
    paddle.jit.save(static, prefix)
    got = _load_in_fresh_process(tmp_path, prefix, {"input_ids": ids, "attention_mask": mask})
    for how in ("jit_load", "predictor"):
        assert _rel(got[how], expected) < 1e-5, (how, _rel(got[how], expected))
