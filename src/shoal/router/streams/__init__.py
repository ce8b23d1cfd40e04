"""A request's stream from workers to the client: the upstream client, relaying, failover and
continuation on another worker, n-choice fan-out, assembly of non-streamed answers, and the
journal that lets a stream outlive its router."""
