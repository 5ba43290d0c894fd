package pdpolicy

import (
	"bytes"
	"encoding/hex"
	"encoding/json"
	"math"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// The published vectors, read from the repository (the single source of truth).
var (
	conformancePath = filepath.Join("..", "..", "controller", "policy", "conformance.json")
	testVectorPath  = filepath.Join("..", "..", "controller", "policy", "test_vector.json")
)

type conformanceFile struct {
	Policies []struct {
		Name   string          `json:"name"`
		Policy json.RawMessage `json:"policy"`
		Cases  []struct {
			Name     string                     `json:"name"`
			Features map[string]json.RawMessage `json:"features"`
			Draw     float64                    `json:"draw"`
			Expect   struct {
				Route    string  `json:"route"`
				Cell     *[3]int `json:"cell"`
				Reason   string  `json:"reason"`
				Explored bool    `json:"explored"`
			} `json:"expect"`
		} `json:"cases"`
	} `json:"policies"`
}

// feature reads a number or one of the strings "NaN", "Infinity", "-Infinity".
func feature(t *testing.T, raw map[string]json.RawMessage, key string, absent float64) float64 {
	v, ok := raw[key]
	if !ok {
		return absent
	}
	var s string
	if json.Unmarshal(v, &s) == nil {
		switch s {
		case "NaN":
			return math.NaN()
		case "Infinity":
			return math.Inf(1)
		case "-Infinity":
			return math.Inf(-1)
		}
		t.Fatalf("feature %s: unexpected string %q", key, s)
	}
	var x float64
	if err := json.Unmarshal(v, &x); err != nil {
		t.Fatalf("feature %s: %v", key, err)
	}
	return x
}

func TestConformanceVectors(t *testing.T) {
	data, err := os.ReadFile(conformancePath)
	if err != nil {
		t.Fatal(err)
	}
	var cf conformanceFile
	if err := json.Unmarshal(data, &cf); err != nil {
		t.Fatal(err)
	}
	cases := 0
	for _, pc := range cf.Policies {
		p, err := Parse(pc.Policy)
		if err != nil {
			t.Fatalf("%s: %v", pc.Name, err)
		}
		for _, c := range pc.Cases {
			f := Features{
				Turn:                 int64(feature(t, c.Features, "turn", 0)),
				ContextTokens:        feature(t, c.Features, "context_tokens", 0),
				AppendTokens:         feature(t, c.Features, "append_tokens", 0),
				ExpectedOutputTokens: feature(t, c.Features, "expected_output_tokens", 0),
				QPS:                  feature(t, c.Features, "qps", 0),
				PrefillWaiting:       feature(t, c.Features, "prefill_waiting", math.NaN()),
			}
			draws := 0
			d := p.Decide(f, func() float64 { draws++; return c.Draw })
			want := c.Expect
			got := d.Route.String() + " " + d.Reason.String()
			if got != want.Route+" "+want.Reason || d.Explored != want.Explored {
				t.Errorf("%s / %s: got %s explored=%v, want %s %s explored=%v", pc.Name,
					c.Name, got, d.Explored, want.Route, want.Reason, want.Explored)
			}
			if (want.Cell == nil) == d.HasCell || (want.Cell != nil && *want.Cell != d.Cell) {
				t.Errorf("%s / %s: cell %v (has %v), want %v", pc.Name, c.Name, d.Cell,
					d.HasCell, want.Cell)
			}
			if draws > 1 {
				t.Errorf("%s / %s: drew %d times", pc.Name, c.Name, draws)
			}
			cases++
		}
	}
	if cases < 30 {
		t.Fatalf("only %d conformance cases ran", cases)
	}
}

type testVector struct {
	Policy   json.RawMessage `json:"policy"`
	BytesHex string          `json:"canonical_bytes_hex"`
	Checksum string          `json:"checksum"`
}

func readTestVector(t *testing.T) testVector {
	data, err := os.ReadFile(testVectorPath)
	if err != nil {
		t.Fatal(err)
	}
	var tv testVector
	if err := json.Unmarshal(data, &tv); err != nil {
		t.Fatal(err)
	}
	return tv
}

func TestPublishedTestVector(t *testing.T) {
	tv := readTestVector(t)
	p, err := Parse(tv.Policy) // the file carries its checksum: Parse verifies it
	if err != nil {
		t.Fatal(err)
	}
	if got := hex.EncodeToString(CanonicalBytes(p)); got != tv.BytesHex {
		t.Fatalf("canonical bytes\n got %s\nwant %s", got, tv.BytesHex)
	}
	if p.Checksum != tv.Checksum {
		t.Fatalf("checksum %s, want %s", p.Checksum, tv.Checksum)
	}
}

// edit returns the test vector's policy with one top-level field replaced.
func edit(t *testing.T, key, value string) []byte {
	var m map[string]json.RawMessage
	if err := json.Unmarshal(readTestVector(t).Policy, &m); err != nil {
		t.Fatal(err)
	}
	if value == "" {
		delete(m, key)
	} else {
		m[key] = json.RawMessage(value)
	}
	out, err := json.Marshal(m)
	if err != nil {
		t.Fatal(err)
	}
	return out
}

func TestChecksumCoversDecisionFieldsOnly(t *testing.T) {
	// Another score with the old checksum: refused.
	if _, err := Parse(edit(t, "scores", "[0.5, -0.0]")); err == nil ||
		!strings.Contains(err.Error(), "checksum: does not match") {
		t.Fatalf("edited scores with the old checksum: %v", err)
	}
	// -0.0 and 0.0 encode alike; version and SLOs are not covered.
	for _, e := range [][2]string{{"scores", "[0.25, 0.0]"}, {"version", "43"},
		{"slo", `{"ttft_s": 3.0, "tpot_s": 0.2}`}} {
		if _, err := Parse(edit(t, e[0], e[1])); err != nil {
			t.Errorf("%s=%s: %v", e[0], e[1], err)
		}
	}
}

func TestBusyOverridesAppendToTheEncoding(t *testing.T) {
	base, err := Parse(edit(t, "checksum", ""))
	if err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct {
		overrides string
		extra     string
	}{
		{`{"first_turn_route": "PREFILL_NODE", "bypass_append_tokens": 64, "first_turn_busy_waiting": 2}`,
			"02000000"},
		{`{"first_turn_route": "PREFILL_NODE", "bypass_append_tokens": 64, "later_turn_busy_waiting": 3}`,
			"0000000003000000"},
	} {
		p, err := Parse(edit(t, "overrides", c.overrides))
		if err == nil {
			t.Fatalf("%s: the old checksum was accepted", c.overrides)
		}
		var m map[string]json.RawMessage
		_ = json.Unmarshal(edit(t, "overrides", c.overrides), &m)
		delete(m, "checksum")
		data, _ := json.Marshal(m)
		if p, err = Parse(data); err != nil {
			t.Fatal(err)
		}
		got := CanonicalBytes(p)
		if !bytes.HasPrefix(got, CanonicalBytes(base)) ||
			hex.EncodeToString(got[len(CanonicalBytes(base)):]) != c.extra {
			t.Errorf("%s: encoding %x", c.overrides, got)
		}
	}
}

func TestRefusals(t *testing.T) {
	for _, c := range []struct {
		name string
		data []byte
		want []string
	}{
		{"unknown key", edit(t, "colour", `"red"`), []string{"unknown field"}},
		{"duplicate key", []byte(`{"schema_version": 1, "version": 2, "version": 99}`),
			[]string{`duplicate key "version"`}},
		{"NaN literal", []byte(`{"schema_version": 1, "version": NaN}`), []string{"not valid JSON"}},
		{"float version", edit(t, "version", "5.0"), []string{"not valid JSON"}},
		{"every problem at once", edit(t, "exploration", "[0.3, -1]"),
			[]string{"exploration[0]", "exploration[1]"}},
		{"edges", edit(t, "axes", `{"context_tokens": [], "io_ratio": [2, 1], "qps": [-1]}`),
			[]string{"axes.context_tokens: needs 1 to 64", "axes.io_ratio[1]", "axes.qps[0]",
				"routes: needs 0 cells"}},
		{"route name", edit(t, "routes", `["DECODE_LOCAL", "SIDEWAYS"]`), []string{"routes[1]"}},
		{"weights", edit(t, "weights", `{"wtft": 0, "wtpot": 0}`), []string{"weights: wtft and wtpot"}},
		{"slo", edit(t, "slo", `{"ttft_s": 0}`), []string{"slo.ttft_s", "slo.tpot_s: missing"}},
		{"schema", edit(t, "schema_version", "2"), []string{"schema_version"}},
		{"provenance", edit(t, "provenance", `{"created_at": "2026-11-30T00:00:00"}`),
			[]string{"provenance.created_at"}},
		{"null object", edit(t, "weights", "null"), []string{`null is not allowed for key "weights"`}},
		{"null number", edit(t, "scores", "[0.25, null]"), []string{"null is not allowed in a list"}},
		{"null route", edit(t, "default_route", "null"), []string{`key "default_route"`}},
		{"null reason", edit(t, "provenance", `{"reason": null}`), []string{`key "reason"`}},
		{"override range", edit(t, "overrides", `{"bypass_append_tokens": 4294967296}`),
			[]string{"overrides.bypass_append_tokens"}},
	} {
		_, err := Parse(c.data)
		if err == nil {
			t.Errorf("%s: accepted", c.name)
			continue
		}
		for _, w := range c.want {
			if !strings.Contains(err.Error(), w) {
				t.Errorf("%s: %q lacks %q", c.name, err.Error(), w)
			}
		}
	}
}
