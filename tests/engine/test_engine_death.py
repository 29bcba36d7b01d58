"""vLLM's dead-engine error becomes the job's EngineDeadError (the job ends: retrying would fail every item);
any other error of an engine call passes through unchanged (the tier worker quarantines its request)."""

from __future__ import annotations

import pytest

from pipeline.generate.engine_api import EngineDeadError
from pipeline.generate.vllm_engine import engine_death


def test_vllms_dead_engine_is_ours_and_other_errors_pass_through():
    from vllm.v1.engine.exceptions import EngineDeadError as VllmDead

    with pytest.raises(EngineDeadError, match="the vLLM engine process died") as raised:
        with engine_death():
            raise VllmDead()
    assert isinstance(raised.value.__cause__, VllmDead)
    with pytest.raises(ValueError, match="a bad request"):
        with engine_death():
            raise ValueError("a bad request")
    with engine_death():
        pass
