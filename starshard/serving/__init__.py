"""The long-document service: many requests over one resident model and its parallel group.

    scheduler.py      Scheduler: the queue, admission within the cache budget, one step at a time (rank 0);
                      every other rank follows the broadcast steps (serve_forever)
    ops.py            the typed operations of a step (Prefill, Extend, Decode, Finish, Evict)
    executor.py       Executor: applies a step's operations to this rank's model, KV shards and batch
    cascade.py        cascade attention: shared cache-entry KV read once per batch, own tokens beside it
    context_cache.py  ContextCache: prefilled prompts' KV kept resident, LRU within a byte budget

A request's walk, from HTTP to a decoded token and back:

1. HTTP route (server/app.py): POST /v1/chat/completions or /v1/completions, after RequestGate
   (server/intake.py: API key, body size, arrival stamp) and FastAPI's validation (server/protocol.py).
2. Intake (server/intake.py, read_job): model name and token budget checked, the prompt tokenized by
   the backend (Scheduler.chat_prompt / text_prompt), a SamplingConfig built -> a Job.
3. Scheduler (scheduler.py): Generation (server/streaming.py) calls Scheduler.submit, which checks the
   window and the cache budget and queues a Request. The scheduler's thread (Scheduler._loop) plans
   each step (_plan / _admit): Finish for cancelled requests, then admit the oldest waiting request as
   [Evict] + Prefill (new document) or Extend (a cache entry holds most of the prompt), else Decode.
4. Executor op broadcast (Scheduler._broadcast): the step, a list of ops.py dataclasses, goes from
   rank 0 to every rank over a CPU (gloo) control group; every rank runs Executor.run(step), so the
   ranks' entries and batch rows stay identical in shape.
5. Runner step (executor.py): Prefill runs the prompt through the LLM's runner (runtime/: any layout
   and context strategy) into a new cache entry; Extend runs only the prompt's rest through the model
   with cascade attention over the entry (cascade.run_cascade).
6. Decode (Executor._decode): one forward for every running request, each entry's KV read once for
   all its rows (a CUDA graph replayed once the batch is steady); tokens are sampled on the query rank
   and shared. Rank 0's scheduler turns each token into text (Scheduler._deliver) and calls the
   request's on_event with a TokenEvent; Generation moves it onto the event loop, applies stop strings,
   and the route answers with one JSON body or server-sent events (server/streaming.py).
"""
