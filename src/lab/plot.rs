//! SVG charts (plotters): line charts (named series of (x, y) points on one frame, with
//! a mesh, axis descriptions and a legend), drawn for the ablation report, the CCA-by-lag
//! plot and the long-tail plot; and interval panels (a mean with its error bar per
//! named category, one panel per group), drawn for the RAG report.

use std::ops::Range;

use plotters::coord::ranged1d::{AsRangedCoord, ValueFormatter};
use plotters::coord::Shift;
use plotters::prelude::*;

use crate::{Error, Result};

/// How a series is drawn.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Mark {
    /// A line `width` pixels wide through the points, with a filled dot of radius `dot`
    /// on each point.
    Line { width: u32, dot: u32 },
    /// An open ring of radius `radius` on each point, no line.
    Ring { radius: u32 },
}

/// One named series of `(x, y)` points; the name goes in the legend.
#[derive(Debug, Clone)]
pub(crate) struct Series<X> {
    pub(crate) name: String,
    pub(crate) points: Vec<(X, f64)>,
    pub(crate) color: RGBAColor,
    pub(crate) mark: Mark,
    /// A vertical error bar `(low, high)` per point, in the points' order; empty for
    /// none.
    pub(crate) bars: Vec<(f64, f64)>,
}

/// The label of the tick at an x value.
type TickLabel<X> = fn(&X) -> String;

/// Everything of a chart but its series; `X` is the type of the x values (`f64`, or
/// `usize` for an axis of counts, which then has whole-number ticks only).
#[derive(Debug, Clone)]
pub(crate) struct Chart<'a, X> {
    /// The caption above the chart.
    pub(crate) title: &'a str,
    /// The caption's font size.
    pub(crate) title_size: u32,
    pub(crate) x_label: &'a str,
    pub(crate) y_label: &'a str,
    pub(crate) x_range: Range<X>,
    /// Positive when `log_y`.
    pub(crate) y_range: Range<f64>,
    /// A logarithmic y axis.
    pub(crate) log_y: bool,
    /// `Some((n, label))`: at most about `n` x ticks, labelled by `label`; `None`:
    /// plotters' ticks and labels.
    pub(crate) x_ticks: Option<(usize, TickLabel<X>)>,
    /// Where the legend goes.
    pub(crate) legend: SeriesLabelPosition,
    /// Width and height in pixels.
    pub(crate) size: (u32, u32),
}

/// The chart as SVG: the series drawn in order, each listed in the legend.
///
/// Errors: plotters' drawing errors, as [`Error::InvalidArgument`] on `plot`.
pub(crate) fn line_chart<X>(chart: &Chart<X>, series: &[Series<X>]) -> Result<String>
where
    X: Copy + 'static,
    Range<X>: AsRangedCoord<Value = X>,
    <Range<X> as AsRangedCoord>::CoordDescType: ValueFormatter<X>,
{
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, chart.size).into_drawing_area();
        root.fill(&WHITE).map_err(plot_error)?;
        let y = chart.y_range.clone();
        if chart.log_y {
            draw(&root, chart, y.log_scale(), series)?;
        } else {
            draw(&root, chart, y, series)?;
        }
        root.present().map_err(plot_error)?;
    }
    Ok(svg)
}

/// Frame, series and legend of `chart` on `root`, with the y axis `y`.
fn draw<X, Y>(
    root: &DrawingArea<SVGBackend, Shift>,
    chart: &Chart<X>,
    y: Y,
    series: &[Series<X>],
) -> Result<()>
where
    X: Copy + 'static,
    Range<X>: AsRangedCoord<Value = X>,
    <Range<X> as AsRangedCoord>::CoordDescType: ValueFormatter<X>,
    Y: AsRangedCoord<Value = f64>,
    Y::CoordDescType: ValueFormatter<f64>,
{
    let mut plot = ChartBuilder::on(root)
        .caption(chart.title, ("sans-serif", chart.title_size))
        .margin(12)
        .x_label_area_size(36)
        // log tick labels (0.001) are wider
        .y_label_area_size(if chart.log_y { 56 } else { 48 })
        .build_cartesian_2d(chart.x_range.clone(), y)
        .map_err(plot_error)?;
    let mut mesh = plot.configure_mesh();
    mesh.x_desc(chart.x_label).y_desc(chart.y_label);
    if let Some((n, label)) = &chart.x_ticks {
        mesh.x_labels(*n).x_label_formatter(label);
    }
    mesh.draw().map_err(plot_error)?;
    for s in series {
        let color = s.color;
        let points = s.points.iter().copied();
        plot.draw_series(s.points.iter().zip(&s.bars).map(|(&(x, y), &(lo, hi))| {
            ErrorBar::new_vertical(x, lo, y, hi, color.stroke_width(1), 6)
        }))
        .map_err(plot_error)?;
        match s.mark {
            Mark::Line { width, dot } => {
                plot.draw_series(LineSeries::new(points.clone(), color.stroke_width(width)))
                    .map_err(plot_error)?
                    .label(s.name.as_str())
                    .legend(move |(x, y)| {
                        PathElement::new(vec![(x, y), (x + 16, y)], color.stroke_width(2))
                    });
                plot.draw_series(points.map(|p| Circle::new(p, dot, color.filled())))
                    .map_err(plot_error)?;
            }
            Mark::Ring { radius } => {
                plot.draw_series(points.map(|p| Circle::new(p, radius, color.stroke_width(2))))
                    .map_err(plot_error)?
                    .label(s.name.as_str())
                    .legend(move |(x, y)| Circle::new((x + 8, y), radius, color.stroke_width(2)));
            }
        }
    }
    plot.configure_series_labels()
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .position(chart.legend.clone())
        .draw()
        .map_err(plot_error)?;
    Ok(())
}

/// One panel of [`interval_panels`]: its caption and, per category, a mean and the
/// half-width of its error bar (`None`: not measured there).
pub(crate) type Panel = (String, Vec<Option<(f64, f64)>>);

/// Panels side by side, one per group, sharing the x axis range: each category of
/// `categories` on its own row (the first at the top), its mean a dot and `mean ± half
/// width` a bar. `x_label` describes the values.
///
/// Errors: plotters' drawing errors, as [`Error::InvalidArgument`] on `plot`.
pub(crate) fn interval_panels(
    title: &str,
    x_label: &str,
    categories: &[String],
    panels: &[Panel],
    size: (u32, u32),
) -> Result<String> {
    let n = categories.len();
    let x_max = panels
        .iter()
        .flat_map(|p| p.1.iter().flatten())
        .map(|(m, h)| m + h)
        .fold(0.05, f64::max)
        * 1.1;
    // Row r (from the top) of category i.
    let row = |i: usize| SegmentValue::CenterOf(n - 1 - i);
    let label = |v: &SegmentValue<usize>| match v {
        SegmentValue::CenterOf(r) | SegmentValue::Exact(r) if *r < n => {
            categories[n - 1 - r].clone()
        }
        _ => String::new(),
    };
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, size).into_drawing_area();
        root.fill(&WHITE).map_err(plot_error)?;
        let root = root.titled(title, ("sans-serif", 18)).map_err(plot_error)?;
        for (area, (caption, values)) in root
            .split_evenly((1, panels.len().max(1)))
            .iter()
            .zip(panels)
        {
            let mut chart = ChartBuilder::on(area)
                .caption(caption, ("sans-serif", 15))
                .margin(10)
                .x_label_area_size(36)
                .y_label_area_size(150)
                .build_cartesian_2d(0.0..x_max, (0..n).into_segmented())
                .map_err(plot_error)?;
            chart
                .configure_mesh()
                .x_desc(x_label)
                .y_labels(n)
                .y_label_formatter(&label)
                .draw()
                .map_err(plot_error)?;
            let color = RGBColor(31, 119, 180);
            for (i, (m, h)) in values
                .iter()
                .enumerate()
                .filter_map(|(i, v)| v.map(|v| (i, v)))
            {
                chart
                    .draw_series(std::iter::once(PathElement::new(
                        vec![((m - h).max(0.0), row(i)), (m + h, row(i))],
                        color.stroke_width(2),
                    )))
                    .map_err(plot_error)?;
                chart
                    .draw_series(std::iter::once(Circle::new((m, row(i)), 4, color.filled())))
                    .map_err(plot_error)?;
            }
        }
        root.present().map_err(plot_error)?;
    }
    Ok(svg)
}

/// A plotters error as this crate's.
fn plot_error(e: impl std::fmt::Display) -> Error {
    Error::invalid("plot", e.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn interval_panels_draw_a_dot_per_measured_category_and_every_label() {
        let categories = vec!["closed-book".to_string(), "rind".to_string()];
        let panels = vec![
            (
                "hotpotqa".to_string(),
                vec![Some((0.1, 0.02)), Some((0.2, 0.05))],
            ),
            ("musique".to_string(), vec![Some((0.05, 0.01)), None]),
        ];
        let svg = interval_panels("F1", "F1", &categories, &panels, (600, 200)).unwrap();
        for text in ["closed-book", "rind", "hotpotqa", "musique"] {
            assert!(svg.contains(text), "{text}");
        }
        assert_eq!(svg.matches("<circle").count(), 3);
    }
}
