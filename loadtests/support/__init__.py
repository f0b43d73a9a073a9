"""What the bench's other folders share, importing none of them:

- :mod:`.processes`: servers as child processes on loopback ports (a free port, the
  proxy's command line, waiting until a server answers);
- :mod:`.postgres`: a real PostgreSQL, a throwaway cluster;
- :mod:`.vllm`: real vLLM (the CPU build) as a child process;
- :mod:`.markdown`: Markdown tables, as the bench's reports print them.
"""
