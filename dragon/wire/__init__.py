"""How a flat fp32 tensor travels among islands: DiLoCo's pseudo-gradients, averaged over rank r
of every island. It knows nothing of DiLoCo's schedule, fragments or membership (dragon.diloco).

- codecs, int4, sparse: how a tensor goes on the wire (fp32, bf16, int8, int4, top-k, SparseLoCo)
  and how the islands' codes sum back to fp32, identical on every island
- exchange: one average among a gloo group, started at once, blocking or in flight, with its bytes
  and times (Exchange), or restored from a checkpoint (FinishedExchange)
- exchange_thread: the thread whose own gloo group runs exchanges in order, off the training thread
"""
