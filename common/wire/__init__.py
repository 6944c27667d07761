"""Every wire message of the mesh, one module per receiving service; the codec in ``codec``.

Import each name from its module (this package re-exports nothing). A message that several
services read is with its main receiver; a request/reply pair is with the service that answers
it (the asker receives the reply). A request's path (docs/architecture.md): gateway ->
tokenizer -> scheduler -> executor -> detokenizer -> gateway.

- ``codec``: ``Message``, ``MessageError``, ``decode_any``, ``SCHEMA_VERSION``, the per-class
  converters and the range-check helpers (``require``, ``id_ok``, ``time_ok``,
  ``page_size_ok``, ``MAX_ID_LEN``, ``MAX_PAGE_SIZE``).
- ``tokenizer``: ``GenerateRequest``, ``ChatMessage``, ``WireSamplingParams``, ``MAX_CHOICES``.
  ``WireSamplingParams`` also rides in ``TokenizedRequest`` and ``DraftSeq``; the gateway
  reads ``MAX_CHOICES`` (its ``--max-n`` bound).
- ``executor``: ``TokenizedRequest``, ``AbortRequests``. The scheduler also receives
  ``TokenizedRequest`` (it queues and forwards it); the scheduler and the detokenizer also
  receive ``AbortRequests``.
- ``scheduler``: ``Heartbeat``, ``RequestStatusQuery``/``RequestStatusReply``. The gateway
  (health) and the prefix index also read ``Heartbeat``.
- ``detokenizer``: ``StepTokens``, ``SeqTokens``, ``StreamStart``, ``WireTokenLogprob``,
  ``StreamProgressRequest``/``StreamProgressReply``.
- ``gateway``: ``TextDeltas``, ``TextDelta``, ``TextLogprob``, ``Usage``, ``ErrorEvent``.
  ``ErrorEvent`` is also the error answer of every request/reply (any asker reads it).
- ``prefix_index``: ``KVEventBatch``, ``IndexMatchRequest``/``IndexMatchReply``.
- ``speculator``: ``ProposeRequest``/``ProposeReply``, ``DraftSeq``, ``DraftTokens``.
- ``presence``: ``Presence``, ``PresenceProbe``, ``MAX_SHARDS``. Every service sends
  ``Presence`` and receives ``PresenceProbe``; the watchers (gateway, scheduler) read
  ``Presence``.

A message's type tag on the wire is its class name, not its module: moving a class between
modules does not change the wire format, renaming it does.

Names: a message that is the wire form of an engine type (``gpu/``) is that type's name with
``Wire`` in front (``WireSamplingParams`` for ``SamplingParams``, ``WireTokenLogprob`` for
``TokenLogprob``), so code that holds both (the executor) says which one it has. Messages with
no engine counterpart carry no prefix; ``TextLogprob`` is a logprob after detokenization (the
token as text), which only the detokenizer and the gateway see.
"""
