"""The client side: a process attached to an engine's segment, around a slot's life.

    client         Client: validate, write a request into a slot, hand out its answer
    attach         finding the engine's segment: at once, after a wait, lazily, after a restart
    handle         the typed interfaces inside: Handle (a Client to its helpers), Item
    ticket         a ticket's answer: wait for it, take it, or give it up
    looks          an asyncio caller's first look at its answer: how long it spins, and when
    future         submit()'s Future, its answer taken in the asking thread
    stdfuture      what that Future relies on of concurrent.futures beyond its API
    completion     the completion thread: settles what is awaited without asking
    loops          answers handed to asyncio event loops, one wake a loop per pass
    wakes          asyncio loops woken by the engine itself: one wake per answer, no thread
    streams        a request's chunks, read as its batcher writes them
    async_streams  those chunks followed by an event loop
    sampled        a sampling engine's requests: their Sampling record, their chunks' cut
    room           making room in a full ring, and the evictor thread that gives it
    shares         the priority shares: how much of the queue each level may hold
    bulk           infer_many(): n requests enqueued, waited for and released in bulk
    lent           request(): a slot lent, its rows written and read in place
    retrying       Client(retries=N): refusals sent again within a budget per process and engine
    deaths         why a timed-out request went unanswered, when its batcher died
    tracing        OpenTelemetry spans of requests, for a caller that traces

The Client's helpers reach it only through handle.Handle, and the completion
thread settles its requests and async streams as handle.Items.
"""
