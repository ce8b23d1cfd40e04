"""Where a request goes: the request as policies see it, the balancer and its policies, the
guessed prefix index and the blocks in flight, KV tier costs, latency targets, worker roles."""
