"""Beams share their KV blocks through the block manager: a fork copies no history."""

from __future__ import annotations

from engine import LLM, BeamSearchParams, SamplingParams
from engine.model_files import DEFAULT_MODEL, resolve_model_path
from engine.outputs import EngineRequest

WIDTH = 4


def test_beams_of_a_long_prompt_share_its_blocks() -> None:
    llm = LLM(str(resolve_model_path(DEFAULT_MODEL)), enforce_eager=True)
    engine = llm.engine
    prompt = (llm.tokenizer.encode("The harbour was quiet at dawn. ") * 100)[:512]
    params = BeamSearchParams(beam_width=WIDTH, max_tokens=6, ignore_eos=True)
    engine.add_request(EngineRequest("beams", prompt, params.to_sampling_params()))
    engine.add_request(EngineRequest("plain", "Hello", SamplingParams(max_tokens=4)))
    widest = 0
    while engine.has_unfinished():
        engine.step()
        beams = engine.scheduler.sequences("beams")
        if len(beams) == WIDTH:
            widest = WIDTH
            one = len(beams[0].block_table)
            held = len({block for seq in beams for block in seq.block_table})
            assert held < 1.2 * one, (held, one)
            shared = beams[0].block_table[0]
            assert engine.block_manager.ref_count(shared) == WIDTH
    assert widest == WIDTH
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_total_blocks
