"""What a run found and how it is shown: trials and their summaries (``results``,
``stats``), the table (``tables``), the plots (``plots``), the machine (``machine``),
what the run left behind (``hygiene``) and the Performance page's tables
(``readme``: docs/performance.md)."""
