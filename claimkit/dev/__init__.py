"""Development tools: the durability demo, the gateway simulator and private Redis servers
for tests (docs/demo.md, docs/redis-server.md). Nothing at runtime imports this package."""
