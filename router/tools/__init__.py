"""Router-executed tools: MCP, web search, code interpreter."""
