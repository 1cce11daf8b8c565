"""`make demo`: the main job on embedded defaults: a long document, a question, time to first token.

The document comes from the Python standard library (present on every machine), the model from PyPI.
"""
from __future__ import annotations

import inspect
import textwrap
import time

from . import libs, models

QUESTION = "In the Python module above, what does the function `dedent` do? Answer in one sentence."


def default_document() -> str:
    return inspect.getsource(textwrap)


def run_demo(model_key: str | None = None, max_tokens: int = 48, echo=print) -> dict:
    key = model_key or models.DEFAULT_MODEL
    model = models.fetch(key, log=echo)
    llama_cpp = libs.use_build("ridgefill")
    llm = llama_cpp.Llama(model_path=str(model), n_ctx=8192, n_batch=512, n_ubatch=512, seed=0, verbose=False)
    document = default_document()
    messages = [{"role": "user", "content": f"```python\n{document}\n```\n\n{QUESTION}"}]
    n_doc = len(llm.tokenize(document.encode(), add_bos=False))
    echo(f"demo: model {model.name}; document: Python's textwrap.py ({n_doc} tokens); question: {QUESTION}")
    echo("demo: RidgeFill is NOT in the engine yet: this is llama.cpp's stock prefill, run through the "
         "patched build (build/ridgefill), which gives the same logits as upstream.")
    llama_cpp.llama_perf_context_reset(llm.ctx)
    t0 = time.perf_counter()
    reply = llm.create_chat_completion(messages=messages, max_tokens=max_tokens, temperature=0.0)
    wall = time.perf_counter() - t0
    perf = llama_cpp.llama_perf_context(llm.ctx)
    answer = reply["choices"][0]["message"]["content"].strip()
    result = {
        "model": model.name,
        "prompt_tokens": reply["usage"]["prompt_tokens"],
        "prompt_ms": perf.t_p_eval_ms,
        "prompt_tokens_per_s": perf.n_p_eval / (perf.t_p_eval_ms / 1000) if perf.t_p_eval_ms else None,
        "generated_tokens": reply["usage"]["completion_tokens"],
        "wall_s": wall,
        "answer": answer,
    }
    echo(f"demo: prefill of {result['prompt_tokens']} tokens took {result['prompt_ms']:.0f} ms "
         f"({result['prompt_tokens_per_s']:.0f} tokens/s; this is the time to first token RidgeFill will cut)")
    echo(f"demo: answer: {textwrap.shorten(answer, 400)}")
    llm.close()
    return result
