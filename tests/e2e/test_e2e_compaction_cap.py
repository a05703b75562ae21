"""The compaction summary has an output cap of its own, through a real router process: a model
that never stops gives a shorter summary, not a 502 after the pool's read timeout."""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest

from harness import RouterProcess, sim_engine_pool_toml, start_router
from router.turns.compaction import SUMMARY_MAX_OUTPUT_TOKENS

pytestmark = pytest.mark.e2e

# A worker that would write 200,000 tokens, 1 ms apart, unless told fewer: about 200 s, where the
# pool waits 20 s for an answer.
ENDLESS = sim_engine_pool_toml("endless", "vllm", model="sim-model", settings="read_timeout_s = 20\n",
                               sim_args=["--default-tokens", "200000", "--max-model-len", "262144", "--itl-ms", "1"])


@pytest.fixture(scope="module")
def router(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RouterProcess]:
    proc = start_router(tmp_path_factory.mktemp("compaction-cap"),
                        ENDLESS + '\n[[models]]\nname = "m"\npool = "endless"\n')
    yield proc
    assert proc.stop() == 0, proc.log()


def test_a_model_that_never_stops_gives_a_summary_cut_at_the_cap(router: RouterProcess) -> None:
    client = openai.OpenAI(base_url=router.base_url + "/v1", api_key="none", max_retries=0, timeout=120)
    compacted = client.responses.compact(model="m", input=[
        {"role": "user", "content": "plan a trip to Lisbon"},
        {"role": "assistant", "content": "Which dates?"},
        {"role": "user", "content": "early May"},
    ])
    assert compacted.output[-1].type == "compaction"
    assert compacted.usage.output_tokens == SUMMARY_MAX_OUTPUT_TOKENS


def test_a_create_past_its_compact_threshold_summarizes_within_the_cap(router: RouterProcess) -> None:
    client = openai.OpenAI(base_url=router.base_url + "/v1", api_key="none", max_retries=0, timeout=120)
    response = client.responses.create(model="m", max_output_tokens=8, input=[
        {"role": "user", "content": "plan a trip to Lisbon"},
        {"role": "assistant", "content": "Which dates?"},
        {"role": "user", "content": "early May"},
    ], extra_body={"context_management": [{"type": "compaction", "compact_threshold": 1}]})
    assert response.output[0].type == "compaction" and response.status == "incomplete"
    assert response.usage.output_tokens == SUMMARY_MAX_OUTPUT_TOKENS + 8
