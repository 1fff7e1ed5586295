"""`disagmoe bench`: runtimes side by side on an emulated bandwidth-limited cluster.

* `netns`     — network namespaces on a bridge, one rate-limited NIC (tc tbf) per node;
* `emulation` — attention and expert math swapped for calibrated waits (`--compute emulated`);
* `runner`    — torchrun per node, interleaved repetitions, metrics and traces collected;
* `analysis`  — exposed communication and bubble from the traces, simulator predictions;
* `cli`       — arguments, table, JSON; `plots` — bar chart and trace pair.
"""
