"""The output checks' measures on crafted cases, `tokenmill checks score`, and `checks calibrate` on a small
labelled set whose figures are worked out by hand below."""

import json

import pytest
from typer.testing import CliRunner

from pipeline.cli import app
from pipeline.config import ChecksConfig
from pipeline.evals.calibrate import calibrate, read_labels, scored
from pipeline.generate.quality import complete_sentences, markup_share, prompt_echo, repetition, unfaithful_terms
from pipeline.generate.shadow import wilson_interval

DOC = (
    "The Artistic License lets anyone copy and distribute the Standard Version of the Package, provided the "
    "copyright notice is kept. Modified versions must be clearly documented and renamed. The Package is "
    "provided as is, without warranty."
)


def test_a_sentence_said_twice_within_40_tokens_is_degenerate():
    twice = (
        "This command is available in beta and might change without notice. "
        "The command is available in beta and might change without notice."
    )
    assert repetition(twice) == 1.0
    assert scored(DOC, twice, "stop", ChecksConfig())["degenerate"]
    # zlib alone misses it: too short to compress below the threshold
    assert scored(DOC, twice, "stop", ChecksConfig(repetition_above=1.0))["degenerate"] is False


def test_a_phrase_said_seven_times_is_degenerate():
    seven = "The FreeType Upstream-Contact: " * 7
    assert repetition(seven) > 0.8 and scored(DOC, seven, "length", ChecksConfig())["degenerate"]


def test_a_prompt_given_back_is_copied_and_prose_is_neither():
    for echo in ("Summarize the following document in a few sentences.", "Write a two-sentence summary of this text."):
        assert prompt_echo(echo) > 0.9 and scored(DOC, echo, "stop", ChecksConfig())["copied"], echo
    prose = "The Artistic License lets anyone copy the Standard Version; modified versions must be renamed."
    assert repetition(prose) == 0.0 and prompt_echo(prose) == 0.0
    assert scored(DOC, prose, "stop", ChecksConfig())["acceptable"]


def test_an_invented_name_and_an_invented_common_noun_are_unfaithful():
    named = "The Artistic License by Larry Wall lets anyone copy the Standard Version."
    assert unfaithful_terms(named, DOC) == ["Larry Wall"] and scored(DOC, named, "stop", ChecksConfig())["unfaithful"]
    refund = "The Artistic License lets anyone copy the Standard Version and promises buyers a refund."
    s = scored(DOC, refund, "stop", ChecksConfig())
    assert s["unsupported_words"] == 3 and not s["unfaithful"]  # promis, buyer, refund; off by default
    assert scored(DOC, refund, "stop", ChecksConfig(unsupported_above=2))["unfaithful"]


def test_score_prints_every_measure_every_flag_and_acceptable(tmp_path):
    path = tmp_path / "in.jsonl"
    path.write_text(json.dumps({"document": DOC, "summary": "The Package comes with no warranty."}) + "\n")
    result = CliRunner().invoke(app, ["checks", "score", "--input", str(path)])
    assert result.exit_code == 0, result.output
    row = json.loads(result.output)
    assert row == scored(DOC, "The Package comes with no warranty.", "stop", ChecksConfig())
    assert {"compression_ratio", "repetition", "prompt_echo", "unsupported_words", "truncated", "acceptable"} <= set(
        row
    )
    path.write_text('{"document": "x"}\n')
    result = CliRunner().invoke(app, ["checks", "score", "--input", str(path)])
    assert result.exit_code == 2 and "in.jsonl:1: expected a JSON object with string fields summary" in result.output


def label(split, verdict, summary, *tags, finish_reason="stop"):
    return {
        "split": split,
        "verdict": verdict,
        "document": DOC,
        "summary": summary,
        "tags": list(tags),
        "finish_reason": finish_reason,
    }


LABELS = [
    # calibration half: unsupported words 0, 2, 1; only the second is labelled unsupported
    label(
        "calibration", "good", "Anyone may copy and distribute the Standard Version; modified versions must be renamed."
    ),
    label(
        "calibration", "bad", "The Artistic License lets anyone copy the Package and promises a refund.", "unsupported"
    ),
    label("calibration", "borderline", "The Package comes without warranty; modified versions must be documented."),
    # test half
    label(
        "test", "good", "The Artistic License lets anyone copy the Standard Version if the copyright notice is kept."
    ),
    label("test", "bad", "Modified versions must be renamed. Modified versions must be renamed.", "repetition"),
    label(
        "test",
        "bad",
        "The Artistic License lets anyone copy the Standard Version and promises buyers a refund.",
        "unsupported",
    ),
    label("test", "bad", "Summarize the following document in a few sentences.", "prompt_echo"),
    label(
        "test", "borderline", "The Artistic License by Larry Wall lets anyone copy the Standard Version.", "unsupported"
    ),
]


def share(hits, n):
    low, high = wilson_interval(hits, n)
    return {"rate": round(hits / n, 4) if n else None, "ci95": [round(low, 4), round(high, 4)], "n": n}


def test_calibrate_gives_the_figures_worked_out_by_hand(tmp_path):
    path = tmp_path / "labels.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in LABELS))
    result = calibrate(read_labels(path), ChecksConfig(), target_precision=0.9)
    # `unsupported_above` and `vague_below` are chosen for `acceptable` (precision at recall >= 0.6): the
    # borderline summary states 4 of the document's topic words, vague below 5 (recall 0.5), so below 4; then
    # above 1 unsupported word flags exactly the bad one (above 0 flags the borderline one's "comes" too).
    # The share of unsupported words stays off and no copy is kept as an extract: neither adds precision. The
    # other checks have no positives to learn from and keep their thresholds.
    assert result["thresholds"] == {
        "degenerate_below": 0.3,
        "repetition_above": 0.3,
        "copied_above": 0.5,
        "prompt_echo_above": 0.0,
        "off_topic_below": 0.25,
        "markup_above": 0.1,
        "extract_min_words": None,
        "unsupported_above": 1,
        "unsupported_share_above": None,
        "vague_below": 4,
    }
    before, after = result["before"]["test"], result["after"]["test"]
    # Before: acceptable = items 1 and 3 (the refund passes); kept by the reader = items 1 and 5 (Larry Wall,
    # borderline, is flagged unfaithful). tp 1, fp 1, fn 1.
    assert before["acceptable"]["precision"] == share(1, 2) and before["acceptable"]["recall"] == share(1, 2)
    assert before["unfaithful"]["precision"] == share(1, 1) and before["unfaithful"]["recall"] == share(1, 2)
    assert before["acceptable"]["bad_kept_by_tag"] == {"unsupported": 1}
    assert before["acceptable"]["kept_lost_by_flag"] == {"unfaithful": 1}
    # After: the refund (3 unsupported words > 1) is unfaithful too: acceptable = item 1 only.
    assert after["acceptable"]["precision"] == share(1, 1) and after["acceptable"]["recall"] == share(1, 2)
    assert after["unfaithful"]["precision"] == share(2, 2) and after["unfaithful"]["recall"] == share(2, 2)
    for flag in ("degenerate", "copied"):
        assert after[flag]["precision"] == share(1, 1) and after[flag]["recall"] == share(1, 1), flag
    assert result["labelled"] == {"calibration": 3, "test": 5}


def test_calibrate_writes_its_thresholds_into_the_config(tmp_path):
    labels, config = tmp_path / "labels.jsonl", tmp_path / "c.yaml"
    labels.write_text("".join(json.dumps(r) + "\n" for r in LABELS))
    config.write_text((__import__("pathlib").Path(__file__).parents[2] / "configs" / "local.yaml").read_text())
    args = ["checks", "calibrate", "--labels", str(labels), "--config", str(config), "--update-config"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert "unfaithful" in result.output and "unsupported_above: 1" in config.read_text()


@pytest.mark.parametrize(
    "line, says",
    [
        ('{"document": "d", "summary": "s", "verdict": "fine"}', "verdict 'fine' is not one of"),
        ("[1]", "expected a JSON"),
    ],
)
def test_bad_labels_are_named(tmp_path, line, says):
    path = tmp_path / "l.jsonl"
    path.write_text(line + "\n")
    result = CliRunner().invoke(app, ["checks", "calibrate", "--labels", str(path)])
    assert result.exit_code == 2 and says in result.output


@pytest.mark.parametrize(
    "cut, served",
    [
        ("The GPL is a licence. It lets users share and chan", "The GPL is a licence."),
        ('It follows v2.0, e.g. the API. He said "yes." Then the', 'It follows v2.0, e.g. the API. He said "yes."'),
        ("See section 1. The tool", "See section 1. The tool"),  # a list number is no sentence end
        ("No sentence ends here at all", "No sentence ends here at all"),
        ("It mentions libpng-0.9. Then it", "It mentions libpng-0.9."),
    ],
)
def test_a_cut_output_is_served_to_its_last_complete_sentence(cut, served):
    assert complete_sentences(cut) == served


def test_a_summary_that_names_its_topic_and_says_nothing_is_vague():
    setterm = "NAME setterm - set terminal attributes. DESCRIPTION setterm writes to standard output a string."
    s = scored(setterm, "The document is a summary of the setterm command.", "stop", ChecksConfig())
    assert s["content_words"] == 1 and s["vague"] and not s["acceptable"]
    said = "setterm writes to standard output the string that sets terminal attributes."
    assert not scored(setterm, said, "stop", ChecksConfig())["vague"]


def test_a_cut_output_trimmed_to_a_sentence_is_not_truncated_one_cut_mid_word_is():
    assert not scored(DOC, "The Package is provided as is.", "length", ChecksConfig())["truncated"]
    assert scored(DOC, "The Package is provided as is, without warr", "length", ChecksConfig())["truncated"]


def test_a_clause_said_again_is_a_repeat_and_a_name_said_again_is_not():
    clause = "It uses getsizeof to determine the size of the module, then to determine the size of the module again."
    assert repetition(clause) == 1.0
    name = "The GNU General Public License (GPL) protects users. The GNU General Public License (GPL) is old."
    assert repetition(name) < 0.3


def test_a_code_block_or_a_file_list_given_back_is_markup_and_prose_or_bullets_are_not():
    fenced = "This document is a summary of the following command:\n\n```\n# gcloud beta dns managed-zones\n```"
    assert markup_share(fenced) > 0.4 and scored(DOC, fenced, "stop", ChecksConfig())["markup"]
    files = "Files: BUILDING.md CMakeLists.txt ChangeLog.md LICENSE.md README.md"
    assert markup_share(files) == 1.0
    underlined = "Conventions\n===========\n\nThe Package is provided as is."
    assert 0.1 < markup_share(underlined) < 0.5  # the underline; its sentence is prose
    bullets = "The Artistic License:\n- lets anyone copy the Standard Version\n- asks that modified versions be renamed"
    assert markup_share(bullets) < 0.3  # a label opening a list of points, not a form given back
    prose = "Note: the Package is provided as is, without warranty."
    assert markup_share(prose) == 0.0 and not scored(DOC, prose, "stop", ChecksConfig())["markup"]


@pytest.mark.parametrize(
    "echo",
    [
        "The following is a two-sentence summary of the Package.",
        "Here is a summary of the text in a numbered format:",
        "This document is a summary of the following command:",
        "Here's a brief summary of the document.",
    ],
)
def test_the_prompts_form_said_back_is_an_echo(echo):
    assert prompt_echo(echo) > 0.2 and scored(DOC, echo, "stop", ChecksConfig())["copied"]


def test_a_summary_mostly_of_words_its_document_lacks_is_unfaithful_by_share():
    invented = "The Artistic License promises buyers refunds, warranties and lifetime telephone support."
    s = scored(DOC, invented, "stop", ChecksConfig())
    assert s["unsupported_share"] > 0.5 and not s["unfaithful"]  # off by default
    assert scored(DOC, invented, "stop", ChecksConfig(unsupported_share_above=0.5))["unfaithful"]
    faithful = "The Artistic License lets anyone copy and distribute the Standard Version of the Package."
    assert scored(DOC, faithful, "stop", ChecksConfig(unsupported_share_above=0.5))["unsupported_share"] == 0.0


def test_an_extract_of_the_documents_key_sentences_is_kept_a_short_copy_is_not():
    extract = (
        "The Artistic License lets anyone copy and distribute the Standard Version of the Package, provided the "
        "copyright notice is kept. Modified versions must be clearly documented and renamed."
    )
    s = scored(DOC, extract, "stop", ChecksConfig())
    assert s["copied"] and s["content_words"] >= 10
    assert not scored(DOC, extract, "stop", ChecksConfig(extract_min_words=10))["copied"]
    opening = "The Artistic License lets anyone copy and distribute the Standard Version of the Package."
    assert scored(DOC, opening, "stop", ChecksConfig(copied_above=0.5, extract_min_words=10))["copied"]


def test_the_example_a_reader_would_keep_ranks_above_a_repeat_an_echo_and_a_terse_one():
    from pipeline.generate.quality import keep_rank

    said = "The Artistic License lets anyone copy the Standard Version; modified versions must be renamed."
    repeat = "The Package is provided as is. The Package is provided as is."
    echo = "Here is a summary of the text: the Package is provided as is, without warranty."
    terse = "The Package is provided as is."
    assert max([repeat, echo, terse, said], key=keep_rank) == said
    assert keep_rank(terse) > keep_rank(echo) and keep_rank(terse) > keep_rank(repeat)


def test_a_token_loop_within_a_word_is_a_repeat_and_ordinary_words_are_not():
    looped = "It describes the AUTH_AUTH_PAM_AUTH_PAM_AUTH_PAM_AUTH_PAM module, which sets the issue at login."
    assert repetition(looped) == 1.0 and scored(DOC, looped, "stop", ChecksConfig())["degenerate"]
    for word in ("bananas", "Mississippi", "assesses", "barbarian", "tartar", "murmur", "ha-ha"):
        assert repetition(f"The {word} of the Package is documented.") < 0.3, word
