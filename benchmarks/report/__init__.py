"""What a run found and how it is shown: trials and their summaries (``results``,
``stats``), the table (``tables``), the plots (``plots``), the machine (``machine``),
what the run left behind (``hygiene``) and the README's Performance section (``readme``)."""
