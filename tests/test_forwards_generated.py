"""The converted forwards are ordinary source (paddle_unpad/models/forwards_generated.py),
written from the family tables; these tests keep the file, the tables and PaddleNLP in step."""

import inspect

import pytest

pytest.importorskip("paddlenlp.transformers")  # the tables name PaddleNLP's classes

from paddle_unpad.models import bert, forwards, forwards_generated  # noqa: E402


def test_committed_file_is_what_the_tables_render():
    # render() also refuses any table row whose parameters differ from the installed PaddleNLP forward
    assert forwards.GENERATED_PATH.read_text() == forwards.render(), (
        "forwards_generated.py is stale: python -m paddle_unpad.models.forwards --write"
    )


def test_a_changed_paddlenlp_forward_is_refused():
    with pytest.raises(ValueError, match="BertModel.forward"):
        forwards.check_signature(bert.modeling.BertModel, forwards.forward_args("use_cache"), bert.REQUIRED)
    with pytest.raises(ValueError, match="BertForMaskedLM.forward"):  # a default where PaddleNLP has none
        forwards.check_signature(bert.modeling.BertForMaskedLM, bert.FORWARDS[-1][2], ())


def test_every_converted_forward_lives_in_the_generated_file():
    mixins = [m for family in forwards_generated.HEADS.values() for m in family.values()]
    assert len(mixins) == sum(len(fam.FORWARDS) for fam in forwards._families())
    for mixin in mixins:
        assert inspect.getsourcefile(mixin.forward) == str(forwards.GENERATED_PATH)
        assert inspect.getsource(mixin.forward).lstrip().startswith("def forward(self, input_ids")
