package pdpolicy

import (
	"bufio"
	"fmt"
	"io"
	"math"
	"sort"
	"strconv"
	"sync"
	"sync/atomic"
	"time"
)

// Fixed bins of the pdrouter_* metrics, copied from controller/policy/bins.py.
// They do not depend on the policy's axes, so series stay comparable across versions.
var (
	FeatureContextEdges = []float64{256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072}
	FeatureIORatioEdges = []float64{0.125, 0.25, 0.5, 1, 2, 4, 8, 16, 32, 64}
	TTFTBucketsS        = []float64{0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60}
	TPOTBucketsS        = []float64{0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3,
		0.5, 1, 2}
)

// Bin labels beside the edges' own: beyond the last edge, and a NaN/negative/infinite value.
const (
	OverflowBin = "+Inf"
	UnknownBin  = "unknown"
)

// SLO labels of pdrouter_requests_total.
const (
	SLOMet      = "met"
	SLOTTFTMiss = "ttft_miss"
	SLOTPOTMiss = "tpot_miss"
	SLOBothMiss = "both_miss"
)

// EdgeLabel is a bin's label: its inclusive upper edge written compactly ("1024", "0.125"),
// as edge_label in controller/policy/bins.py.
func EdgeLabel(e float64) string {
	if e == math.Trunc(e) && math.Abs(e) < 1e15 {
		return strconv.FormatInt(int64(e), 10)
	}
	return strconv.FormatFloat(e, 'g', -1, 64)
}

// BinLabel is the label of value's fixed bin on edges (inclusive upper edges).
func BinLabel(edges []float64, v float64) string {
	if !(v >= 0) || math.IsInf(v, 1) {
		return UnknownBin
	}
	i := sort.SearchFloat64s(edges, v)
	if i >= len(edges) {
		return OverflowBin
	}
	return EdgeLabel(edges[i])
}

type histogram struct {
	counts []uint64 // per bucket, not cumulative; the last is the overflow
	sum    float64
	count  uint64
}

func (h *histogram) observe(edges []float64, v float64) {
	if h.counts == nil {
		h.counts = make([]uint64, len(edges)+1)
	}
	h.counts[sort.SearchFloat64s(edges, v)]++
	h.sum += v
	h.count++
}

type requestKey struct{ route, ctx, io, slo string }
type latencyKey struct{ route, ctx string }

// Metrics holds the pdrouter_* series of one router and writes them as Prometheus text
// (format 0.0.4). The daemon reads the minimum set (docs/adopting.md): requests_total,
// ttft_seconds, tpot_seconds, context_tokens, io_ratio and qps; decisions_total,
// policy_version, policy_age_seconds and updates_total feed the dashboards and alerts.
type Metrics struct {
	mu       sync.Mutex
	requests map[requestKey]uint64
	ttft     map[latencyKey]*histogram
	tpot     map[latencyKey]*histogram
	// decisions[route][reason]: lock-free, CountDecision sits on the decision hot path.
	decisions [3][len(reasonNames)]atomic.Uint64
	context   histogram
	ioRatio   histogram
	qps       float64
}

// NewMetrics returns empty metrics.
func NewMetrics() *Metrics {
	return &Metrics{requests: map[requestKey]uint64{}, ttft: map[latencyKey]*histogram{},
		tpot: map[latencyKey]*histogram{}}
}

// CountDecision counts one decision (pdrouter_decisions_total{route,reason}); one atomic
// add, safe from any goroutine.
func (m *Metrics) CountDecision(d Decision) {
	if d.Route <= DecodeLocal && int(d.Reason) < len(reasonNames) {
		m.decisions[d.Route][d.Reason].Add(1)
	}
}

// SetQPS records the arrival rate last passed to Decide (pdrouter_qps).
func (m *Metrics) SetQPS(qps float64) {
	m.mu.Lock()
	m.qps = qps
	m.mu.Unlock()
}

// Observe counts one completed request routed by d, with its features, judged against the
// SLOs (seconds) of the policy in force. hasTPOT is false for a request with one output
// token (it has no TPOT and meets it). It returns the request's SLO label.
func (m *Metrics) Observe(d Decision, f Features, ttftS, tpotS float64, hasTPOT bool,
	sloTTFT, sloTPOT float64) string {
	ttftOK := ttftS <= sloTTFT && !math.IsInf(ttftS, 0)
	tpotOK := !hasTPOT || (tpotS <= sloTPOT && !math.IsInf(tpotS, 0))
	label := SLOMet
	switch {
	case !ttftOK && !tpotOK:
		label = SLOBothMiss
	case !ttftOK:
		label = SLOTTFTMiss
	case !tpotOK:
		label = SLOTPOTMiss
	}
	ctx := BinLabel(FeatureContextEdges, f.ContextTokens)
	io := UnknownBin
	if out := f.ExpectedOutputTokens; out > 0 && !math.IsInf(out, 1) {
		io = BinLabel(FeatureIORatioEdges, f.AppendTokens/out)
	}
	route := d.Route.String()
	m.mu.Lock()
	defer m.mu.Unlock()
	if ctx != UnknownBin {
		m.context.observe(FeatureContextEdges, f.ContextTokens)
	}
	if io != UnknownBin {
		m.ioRatio.observe(FeatureIORatioEdges, f.AppendTokens/f.ExpectedOutputTokens)
	}
	m.requests[requestKey{route, ctx, io, label}]++
	if ttftS >= 0 && !math.IsInf(ttftS, 1) {
		observeLatency(m.ttft, latencyKey{route, ctx}, TTFTBucketsS, ttftS)
	}
	if hasTPOT && tpotS >= 0 && !math.IsInf(tpotS, 1) {
		observeLatency(m.tpot, latencyKey{route, ctx}, TPOTBucketsS, tpotS)
	}
	return label
}

func observeLatency(hs map[latencyKey]*histogram, k latencyKey, edges []float64, v float64) {
	h := hs[k]
	if h == nil {
		h = &histogram{}
		hs[k] = h
	}
	h.observe(edges, v)
}

// WriteText writes every series as Prometheus text. w may be nil (no policy file watched:
// version 0, age -1, no updates).
func (m *Metrics) WriteText(out io.Writer, w *Watcher) error {
	b := bufio.NewWriter(out)
	m.mu.Lock()
	m.writeRequests(b)
	writeLatency(b, "pdrouter_ttft_seconds", "Time to first token by route and fixed context bin.",
		m.ttft, TTFTBucketsS)
	writeLatency(b, "pdrouter_tpot_seconds",
		"Time per output token (after the first) by route and fixed context bin.", m.tpot, TPOTBucketsS)
	writeHistogram(b, "pdrouter_context_tokens", "", FeatureContextEdges, &m.context)
	writeHistogram(b, "pdrouter_io_ratio", "", FeatureIORatioEdges, &m.ioRatio)
	fmt.Fprintf(b, "# HELP pdrouter_qps The router's windowed arrival rate (requests/s).\n"+
		"# TYPE pdrouter_qps gauge\npdrouter_qps %s\n", num(m.qps))
	m.writeDecisions(b)
	m.mu.Unlock()
	writePolicy(b, w)
	return b.Flush()
}

func (m *Metrics) writeRequests(b *bufio.Writer) {
	b.WriteString("# HELP pdrouter_requests_total Completed requests by route, fixed context " +
		"bin, fixed io-ratio bin and SLO outcome.\n# TYPE pdrouter_requests_total counter\n")
	keys := make([]requestKey, 0, len(m.requests))
	for k := range m.requests {
		keys = append(keys, k)
	}
	sort.Slice(keys, func(i, j int) bool {
		a, c := keys[i], keys[j]
		return a.route+a.ctx+a.io+a.slo < c.route+c.ctx+c.io+c.slo
	})
	for _, k := range keys {
		fmt.Fprintf(b, "pdrouter_requests_total{route=%q,ctx_bin=%q,io_bin=%q,slo=%q} %d\n",
			k.route, k.ctx, k.io, k.slo, m.requests[k])
	}
}

func (m *Metrics) writeDecisions(b *bufio.Writer) {
	b.WriteString("# HELP pdrouter_decisions_total Routing decisions by route and reason.\n" +
		"# TYPE pdrouter_decisions_total counter\n")
	for _, r := range []Route{PrefillNode, DecodeLocal} {
		for _, why := range Reasons() {
			fmt.Fprintf(b, "pdrouter_decisions_total{route=%q,reason=%q} %d\n", r.String(),
				why.String(), m.decisions[r][why].Load())
		}
	}
}

func writeLatency(b *bufio.Writer, name, help string, hs map[latencyKey]*histogram,
	edges []float64) {
	fmt.Fprintf(b, "# HELP %s %s\n# TYPE %s histogram\n", name, help, name)
	keys := make([]latencyKey, 0, len(hs))
	for k := range hs {
		keys = append(keys, k)
	}
	sort.Slice(keys, func(i, j int) bool {
		return keys[i].route+keys[i].ctx < keys[j].route+keys[j].ctx
	})
	for _, k := range keys {
		labels := fmt.Sprintf("route=%q,ctx_bin=%q,", k.route, k.ctx)
		writeSeries(b, name, labels, edges, hs[k])
	}
}

func writeHistogram(b *bufio.Writer, name, labels string, edges []float64, h *histogram) {
	fmt.Fprintf(b, "# HELP %s Feature of completed requests (fixed bins).\n# TYPE %s histogram\n",
		name, name)
	writeSeries(b, name, labels, edges, h)
}

func writeSeries(b *bufio.Writer, name, labels string, edges []float64, h *histogram) {
	var cum uint64
	for i, e := range edges {
		if h.counts != nil {
			cum += h.counts[i]
		}
		fmt.Fprintf(b, "%s_bucket{%sle=%q} %d\n", name, labels,
			strconv.FormatFloat(e, 'g', -1, 64), cum)
	}
	trimmed := labels
	if len(trimmed) > 0 {
		trimmed = "{" + trimmed[:len(trimmed)-1] + "}"
	}
	fmt.Fprintf(b, "%s_bucket{%sle=\"+Inf\"} %d\n%s_sum%s %s\n%s_count%s %d\n", name, labels,
		h.count, name, trimmed, num(h.sum), name, trimmed, h.count)
}

func writePolicy(b *bufio.Writer, w *Watcher) {
	version, age := int64(0), -1.0
	var applied, refused uint64
	if w != nil {
		if p := w.Policy(); p != nil {
			version = p.Version
			age = time.Since(w.LoadedAt()).Seconds()
		}
		applied, refused = w.Applied(), w.Refused()
	}
	fmt.Fprintf(b, "# HELP pdrouter_policy_version Version of the policy this router runs "+
		"(0: none).\n# TYPE pdrouter_policy_version gauge\npdrouter_policy_version %d\n", version)
	fmt.Fprintf(b, "# HELP pdrouter_policy_age_seconds Seconds since the running policy was "+
		"loaded (-1: no policy).\n# TYPE pdrouter_policy_age_seconds gauge\n"+
		"pdrouter_policy_age_seconds %s\n", num(age))
	fmt.Fprintf(b, "# HELP pdrouter_updates_total Policy files read, by outcome (applied; "+
		"invalid: refused, the last good policy stays).\n# TYPE pdrouter_updates_total counter\n"+
		"pdrouter_updates_total{result=\"applied\"} %d\n"+
		"pdrouter_updates_total{result=\"invalid\"} %d\n", applied, refused)
}

func num(x float64) string {
	switch {
	case math.IsNaN(x):
		return "NaN"
	case math.IsInf(x, 1):
		return "+Inf"
	case math.IsInf(x, -1):
		return "-Inf"
	}
	return strconv.FormatFloat(x, 'g', -1, 64)
}
