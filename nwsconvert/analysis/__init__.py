"""What a run costs and which kernels it chose: the memory summary of ``nws-info``
(:mod:`.summary`), the kernel-selection analysis (:mod:`.selection`) and ``nws-report``'s plots
and HTML page (:mod:`.html`)."""
