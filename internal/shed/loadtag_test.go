package shed

import "testing"

// TestParseLoadTag: what a load tag may hold.
func TestParseLoadTag(t *testing.T) {
	for raw, ok := range map[string]bool{
		"connections 12 3": true, "cpu 0.5 9": true,
		"": false, "connections 12": false, "connections x 1": false,
		"connections -1 1": false, "connections NaN 1": false, "connections Inf 1": false, "cpu +Inf 2": false,
	} {
		if _, _, got := ParseLoadTag(raw); got != ok {
			t.Errorf("ParseLoadTag(%q): ok %v; want %v", raw, got, ok)
		}
	}
}
