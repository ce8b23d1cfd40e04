"""Who gets in and when: client API keys, rate limits, admission queues by class, fair shares
between tenants, and a router group's shared slots."""
