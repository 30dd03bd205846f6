"""The long-document service: many requests over one resident model and its parallel group.

    scheduler.py      Scheduler: the queue, admission within the cache budget, one step at a time (rank 0);
                      every other rank follows the broadcast steps (serve_forever)
    ops.py            the typed operations of a step (Prefill, PrefillChunk, Abort, Extend, Decode, Finish,
                      Evict)
    executor.py       Executor: applies a step's operations to this rank's model, KV shards and batch
    cascade.py        cascade attention: shared cache-entry KV read once per batch, own tokens beside it
    context_cache.py  ContextCache: prefilled prompts' KV kept resident, LRU within a byte budget
    warmup.py         the start-up warm-up: every kernel shape the steps use, once, on one layer of each kind

A request's walk, from HTTP to a decoded token and back:

1. HTTP route (server/app.py): POST /v1/chat/completions or /v1/completions, after RequestGate
   (server/intake.py: API key, body size, arrival stamp) and FastAPI's validation (server/protocol.py).
2. Intake (server/intake.py, read_job): model name and token budget checked, the prompt tokenized by
   the backend (Scheduler.chat_prompt / text_prompt), a SamplingConfig built -> a Job.
3. Scheduler (scheduler.py): Generation (server/streaming.py) calls Scheduler.submit, which checks the
   window and the cache budget and queues a Request. The scheduler's thread (Scheduler._loop) plans
   each step (_plan): Finish for cancelled and timed-out requests (Abort for a document cancelled
   between its chunks), then a Decode if requests run and the last step was not one, else one
   prefill-side action: [Evict] + Extend (a cache entry holds most of the prompt), or document work,
   taking turns: [Evict] + the next PrefillChunk of the one document being prefilled (--prefill-chunk),
   or a new document's first chunk (or whole Prefill).
4. Executor op broadcast (Scheduler._broadcast): the step, a list of ops.py dataclasses, goes from
   rank 0 to every rank over a CPU (gloo) control group; every rank runs Executor.run(step), so the
   ranks' entries and batch rows stay identical in shape.
5. Runner step (executor.py): Prefill runs the prompt through the LLM's runner (runtime/: any layout
   and context strategy) into a new cache entry, PrefillChunk one runner.prefill_step of it; Extend
   runs only the prompt's rest through the model with cascade attention over the entry
   (cascade.run_cascade). Each admission is prepared, voted on by every rank, computed and voted on
   again, so a failure (out of memory included) fails that request alone on every rank.
6. Decode (Executor._decode): one forward for every running request, each entry's KV read once for
   all its rows (a CUDA graph replayed once the batch is steady); tokens are sampled on the query rank
   and shared. Rank 0's scheduler turns each token into text (Scheduler._deliver) and calls the
   request's on_event with a TokenEvent; Generation moves it onto the event loop, applies stop strings,
   and the route answers with one JSON body or server-sent events (server/streaming.py).
"""
