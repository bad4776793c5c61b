"""Every finding of the fuzzers, kept as an input under tests/fuzz/regressions/<target>/<name>
and replayed through its target: each must now pass. The unit test next to each fix says in
words what was wrong (named in the comment of each case below)."""

from __future__ import annotations

from pathlib import Path

import pytest

from meshfn.testing import fuzz

CASES = sorted(
    (target.name, case.name) for target in fuzz.REGRESSIONS.iterdir() for case in target.iterdir()
)
# policy/unknown-key-like-a-pydantic-tag: an unknown key containing "[" (YAML `spec:[x`) was
#   dropped from the error location as if it were a pydantic tag: IndexError instead of a
#   file:line error (tests/policy/test_policy.py::test_unknown_key_that_looks_like_a_tag).
# policy/duration-past-a-c-int: a duration of 120 digits ("333...ms") overflowed timedelta's
#   C int: OverflowError out of the loader instead of a file:line error
#   (tests/policy/test_policy.py, the connectTimeout case "longer than 365 days").
# policy/drill-caller-with-a-quote: a drill requestPrincipal with '"' passed the policy (any
#   request principal) but not the degrade filter's caller pattern: a pydantic error out of the
#   translator instead of a file:line error (tests/policy/test_policy.py, the drill caller case).
# ads/sotw-node-with-invalid-utf8: a SotW request whose node had invalid UTF-8 passed the lazy
#   head parse and raised DecodeError out of the stream loop: UNKNOWN and a traceback instead
#   of INVALID_ARGUMENT (tests/xds/test_ads.py::test_lazily_parsed_garbage_ends_the_stream_cleanly).
# journal/object-where-a-string-belongs: a log line whose "id" was a JSON object raised
#   TypeError in the record parser, which would stop the collector on one hostile line
#   (tests/audit/test_audit_record.py::test_non_string_fields_are_kept_as_json).
# journal/integer-past-64-bits: a duration_us of 10**31 passed into the record, where the
#   stores' 64-bit column would fail its batch
#   (tests/audit/test_audit_record.py::test_integers_past_64_bits_are_dropped).
# kserve/lone-surrogate-in-bytes: a BYTES input whose JSON string was "\ud800" raised
#   UnicodeEncodeError out of the decoder: a 500 instead of a 400 naming the element
#   (tests/inference/test_inference_units.py::test_bad_requests_are_400_with_a_reason).
# generate/lone-surrogate-in-a-prompt: a text completion whose prompt was "\ud800" (valid JSON,
#   no text) passed the OpenAI parser and failed in the tokenizer's UTF-8 encode: a 500 instead
#   of a 400 naming the field (tests/inference/test_generation_units.py::
#   test_text_with_a_lone_surrogate_is_a_400_naming_the_field).


@pytest.mark.parametrize(("target", "name"), CASES, ids=[f"{t}/{n}" for t, n in CASES])
def test_fuzz_finding_stays_fixed(target: str, name: str, tmp_path: Path) -> None:
    done = fuzz.replay(target, [fuzz.REGRESSIONS / target / name], tmp_path)
    assert done.returncode == 0, done.stderr[-4000:]
