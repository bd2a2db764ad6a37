"""The simulator's POST /v1/audio/transcriptions (backends/sim/audio_api.py) over real sockets, in vLLM's shapes:
the transcript a function of the audio alone (same file, same words; length from the WAV header), JSON/text with
usage in seconds, verbose_json segments, the stream with a final token usage (decoder prompt + 100 audio tokens
per second) whose text is the JSON's, a max_completion_tokens cut, and vLLM's refusals."""
from __future__ import annotations

import io
import json
import math
import wave

import httpx

from backends.sim.audio_api import AUDIO_TOKENS_PER_S, DECODER_SPECIAL_TOKENS, transcript_words
from backends.sim.fleet import start_fleet


def wav(seconds: float, rate: int = 16000, tone: int = 1) -> bytes:
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(bytes([tone % 256, 0]) * int(seconds * rate))
    return buf.getvalue()


def events(raw: str) -> list[dict]:
    out = []
    for block in raw.strip().split("\n\n"):
        data = block.removeprefix("data: ")
        out.append({"done": True} if data == "[DONE]" else json.loads(data))
    return out


async def test_transcript_usage_stream_and_refusals():
    a, b = wav(2.0, tone=1), wav(2.0, tone=2)
    want = "".join(transcript_words(a, 2.0))
    assert len(transcript_words(a, 2.0)) == 5 and want != "".join(transcript_words(b, 2.0))
    async with start_fleet(1, profiles=["tiny"]) as fleet:
        url = fleet[0].url + "/audio/transcriptions"
        async with httpx.AsyncClient(timeout=10) as c:
            async def post(audio: bytes = a, name: str = "a.wav", **data):
                return await c.post(url, data={"model": "sim-model", **data},
                                    files={"file": (name, audio, "audio/wav")})

            for fmt in ("json", "text"):
                r = await post(response_format=fmt)
                assert r.status_code == 200, r.text
                assert r.json() == {"text": want, "usage": {"type": "duration", "seconds": 2}}
            assert (await post(b)).json()["text"] != want  # other audio, other words
            r = await post(response_format="verbose_json", language="de")
            v = r.json()
            assert v["text"] == want and v["language"] == "de" and float(v["duration"]) == 2.0 and "usage" not in v
            assert "".join(s["text"] for s in v["segments"]) == want
            assert sum(len(s["tokens"]) for s in v["segments"]) == 5

            r = await post(stream="true", stream_include_usage="true", prompt="Names: Ada, Bob.")
            assert r.headers["content-type"].startswith("text/event-stream")
            evs = events(r.text)
            assert evs[-1] == {"done": True} and all(e["object"] == "transcription.chunk" for e in evs[:-1])
            text = "".join(ch["delta"]["content"] for e in evs[:-1] for ch in e["choices"])
            assert text == want and evs[-3]["choices"][0]["finish_reason"] == "stop"
            u = evs[-2]["usage"]
            decoder = DECODER_SPECIAL_TOKENS + 1 + len(fleet[0].engine.tokenizer.encode("Names: Ada, Bob."))
            assert u == {"prompt_tokens": decoder + math.ceil(2.0 * AUDIO_TOKENS_PER_S), "completion_tokens": 5,
                         "total_tokens": decoder + 200 + 5}
            r = await post(stream="true", stream_include_usage="true", max_completion_tokens="2")
            evs = events(r.text)
            assert evs[-3]["choices"][0]["finish_reason"] == "length" and evs[-2]["usage"]["completion_tokens"] == 2
            assert "".join(ch["delta"]["content"] for e in evs[:-1] for ch in e["choices"]) == \
                "".join(transcript_words(a, 2.0)[:2])

            for data, msg in [({"response_format": "srt"}, "response_format"),
                              ({"stream_include_usage": "true"}, "Stream options"),
                              ({"stream": "true", "response_format": "verbose_json"}, "verbose_json")]:
                r = await post(**data)
                assert r.status_code == 400 and msg in r.json()["error"]["message"], r.text
            r = await post(b"not audio at all")
            assert r.status_code == 400 and r.json()["error"]["message"] == "Invalid or unsupported audio file."
            r = await c.post(url, files={"model": (None, "sim-model")})
            assert r.status_code == 400 and r.json()["error"]["param"] == "file"
            r = await c.post(url, data={"model": "nope"}, files={"file": ("a.wav", a, "audio/wav")})
            assert r.status_code == 404
